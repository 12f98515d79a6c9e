//! Gradients of the whole GPT (autodiff) against central finite differences, in float64.
//! (In a process of its own: the f64 default is set once per process on the Flex device.)

use std::collections::HashMap;

use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};
use ferrotron::model::named_parameters::{load_named_parameters, named_parameters};
use ferrotron::model::{lm_loss, Gpt, GptConfig};
use ferrotron::training::GradientAccumulator;
use ferrotron::util::init::{master_values, Init};

use crate::common::own_process::ran_in_own_process;

type Params = HashMap<String, (Vec<usize>, Vec<f32>)>;

fn batch(device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>, Tensor<2>) {
    let tokens = vec![3i64, 17, 19, 0, 5, 5, 12, 11, 13, 1, 9, 2];
    let labels = vec![17i64, 19, 0, 5, 5, 12, 11, 13, 1, 9, 2, 7];
    let mask = vec![
        1.0f32, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0,
    ];
    (
        Tensor::from_data(TensorData::new(tokens, [2, 6]), device),
        Tensor::from_data(TensorData::new(labels, [2, 6]), device),
        Tensor::from_data(TensorData::new(mask, [2, 6]), device),
    )
}

fn loss_of(model: &Gpt, device: &Device) -> Tensor<1> {
    let (tokens, labels, mask) = batch(device);
    lm_loss(model.forward(tokens), labels, mask)
}

#[test]
fn autodiff_gradients_match_finite_differences() {
    if ran_in_own_process() {
        return;
    }
    let mut device = Device::flex();
    device
        .configure(FloatDType::F64)
        .expect("f64 before any tensor");
    let autodiff = device.clone().autodiff();
    let config = GptConfig::new(2, 8, 2, 8, 20)
        .with_ffn_hidden_size(Some(12))
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0);
    let model = config.init(3, &autodiff).unwrap();
    let params: Params = named_parameters(&model)
        .into_iter()
        .map(|p| {
            let mut v = master_values(Init::Normal(0.4), &p.shape, 5, &p.name);
            if p.name.ends_with("layernorm.weight") {
                v.iter_mut().for_each(|x| *x += 1.0);
            }
            (p.name, (p.shape, v))
        })
        .collect();
    let (model, _) = load_named_parameters(model, &params);
    let mut grads = GradientAccumulator::default();
    grads.add(&model, loss_of(&model, &autodiff).backward());

    let eval = |p: &Params| -> f64 {
        let (m, _) = load_named_parameters(config.init(3, &device).unwrap(), p);
        loss_of(&m, &device).into_scalar::<f64>()
    };
    let mut checked = 0;
    let mut worst = 0.0f64;
    for named in named_parameters(&model) {
        let analytic: Vec<f64> = grads
            .get(&named.id)
            .expect("every parameter has a gradient")
            .clone()
            .try_into_vec_as::<f64>()
            .unwrap();
        let n = analytic.len();
        for &i in &[0, n / 3, n / 2, n - 1] {
            let mut plus = params.clone();
            let mut minus = params.clone();
            let base = params[&named.name].1[i];
            let (hi, lo) = (base + 1e-3, base - 1e-3);
            plus.get_mut(&named.name).unwrap().1[i] = hi;
            minus.get_mut(&named.name).unwrap().1[i] = lo;
            // Divide by the step actually stored (the values are f32), so rounding of the
            // perturbation does not enter the comparison.
            let numeric = (eval(&plus) - eval(&minus)) / (hi as f64 - lo as f64);
            let err = (numeric - analytic[i]).abs();
            assert!(
                err <= 1e-6 + 1e-4 * numeric.abs(),
                "{}[{i}]: autodiff {} vs finite difference {numeric}",
                named.name,
                analytic[i]
            );
            worst = worst.max(err);
            checked += 1;
        }
    }
    assert!(checked >= 100, "checked {checked} entries");
    eprintln!("checked {checked} gradient entries; worst absolute difference {worst:.3e}");
}
