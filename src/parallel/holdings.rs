//! How a built model holds each of its parameters, read off the declarations of its parallel
//! layers ([`DeclaresHoldings`]): what checkpoints, the gradient norm and the optimizers ask.
//! Apart from [`super::sharding`] so that the layers, which build their shards from
//! `sharding`, and this reader, which knows every layer, do not import each other.

use std::any::type_name;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;

use super::layers::{ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding};
use super::sharding::{DeclaresHoldings, Holding};

/// A parameter of a built module: its id, dotted name and holding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParameterHolding {
    /// burn's id.
    pub id: ParamId,
    /// Dotted path (`layers.0.mlp.dense_h_to_4h.weight`).
    pub name: String,
    /// How this rank holds it.
    pub holding: Holding,
}

/// Walks a module: the innermost struct around each parameter says how it is held.
struct ReadHoldings {
    path: Vec<(String, String)>,
    out: Vec<ParameterHolding>,
}

/// burn's container name for the struct `T` (`Struct:ColumnParallelLinear`).
fn struct_container<T>() -> String {
    let full = type_name::<T>();
    format!("Struct:{}", full.rsplit("::").next().unwrap_or(full))
}

/// The holding a parallel layer of container type `container` declares for `field`.
fn declared(container: &str, field: &str) -> Holding {
    if container == struct_container::<ColumnParallelLinear>() {
        ColumnParallelLinear::holding(field)
    } else if container == struct_container::<RowParallelLinear>() {
        RowParallelLinear::holding(field)
    } else if container == struct_container::<VocabParallelEmbedding>() {
        VocabParallelEmbedding::holding(field)
    } else {
        Holding::Duplicated
    }
}

impl ModuleVisitor for ReadHoldings {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.path.push((name.to_owned(), container.to_owned()));
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let holding = match self.path.last() {
            Some((field, container)) => declared(container, field),
            None => Holding::Duplicated,
        };
        let name = self
            .path
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(".");
        self.out.push(ParameterHolding {
            id: param.id,
            name,
            holding,
        });
    }
}

/// Every parameter of `module`, in declaration order, with how this rank holds it.
pub fn parameter_holdings<M: Module>(module: &M) -> Vec<ParameterHolding> {
    let mut visitor = ReadHoldings {
        path: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut visitor);
    visitor.out
}
