//! Every parameter of a module with its dotted name (`layers.0.mlp.dense_h_to_4h.weight`),
//! for checkpoints, export and tests.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Tensor, TensorData};
use std::collections::HashMap;

/// A parameter's name, id, shape and values (row-major f32).
#[derive(Clone, Debug, PartialEq)]
pub struct NamedValues {
    /// Dotted path.
    pub name: String,
    /// burn's id of the parameter.
    pub id: ParamId,
    /// Shape.
    pub shape: Vec<usize>,
    /// Values.
    pub values: Vec<f32>,
}

#[derive(Default)]
struct Path(Vec<String>);

impl Path {
    fn enter(&mut self, name: &str) {
        self.0.push(name.to_owned());
    }
    fn exit(&mut self) {
        self.0.pop();
    }
    fn joined(&self) -> String {
        self.0.join(".")
    }
}

struct Collect {
    path: Path,
    out: Vec<NamedValues>,
    with_values: bool,
}

impl ModuleVisitor for Collect {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let tensor = param.val();
        let shape = tensor.dims().to_vec();
        let values = if self.with_values {
            tensor
                .try_into_vec_as::<f32>()
                .expect("parameters are float tensors")
        } else {
            Vec::new()
        };
        self.out.push(NamedValues {
            name: self.path.joined(),
            id: param.id,
            shape,
            values,
        });
    }
}

/// All parameters of `module` with their values, in declaration order.
pub fn named_parameters<M: Module>(module: &M) -> Vec<NamedValues> {
    let mut visitor = Collect {
        path: Path::default(),
        out: Vec::new(),
        with_values: true,
    };
    module.visit(&mut visitor);
    visitor.out
}

/// Names, ids and shapes only (no device reads).
pub fn parameter_names<M: Module>(module: &M) -> Vec<NamedValues> {
    let mut visitor = Collect {
        path: Path::default(),
        out: Vec::new(),
        with_values: false,
    };
    module.visit(&mut visitor);
    visitor.out
}

struct Load<'a> {
    path: Path,
    values: &'a HashMap<String, (Vec<usize>, Vec<f32>)>,
    missing: Vec<String>,
}

impl ModuleMapper for Load<'_> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let name = self.path.joined();
        let (id, old, mapper) = param.consume();
        let shape = old.dims();
        match self.values.get(&name) {
            Some((s, v)) if s.as_slice() == shape.as_slice() => {
                let device = old.device();
                let new = Tensor::<D>::from_data(TensorData::new(v.clone(), shape), &device);
                let new = if new.is_autodiff() {
                    new.require_grad()
                } else {
                    new
                };
                Param::from_mapped_value(id, new, mapper)
            }
            _ => {
                self.missing.push(name);
                Param::from_mapped_value(id, old, mapper)
            }
        }
    }
}

/// Replaces every parameter of `module` by the values of the same name and shape; returns
/// the module and the names that had no matching entry.
pub fn load_named_parameters<M: Module>(
    module: M,
    values: &HashMap<String, (Vec<usize>, Vec<f32>)>,
) -> (M, Vec<String>) {
    let mut mapper = Load {
        path: Path::default(),
        values,
        missing: Vec::new(),
    };
    let module = module.map(&mut mapper);
    (module, mapper.missing)
}
