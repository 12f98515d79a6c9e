//! Megatron's loss scalers (`optimizer/grad_scaler.py`): fp16's narrow range makes small
//! gradients underflow to zero, so the loss is multiplied by a scale before the backward pass
//! and the gradients divided by it after. A dynamic scale starts high, halves when gradients
//! overflow (after `hysteresis` overflows) and doubles after `growth_interval` clean steps.

use serde::{Deserialize, Serialize};

/// `--initial-loss-scale`, `--min-loss-scale`, `--loss-scale-window`, `--hysteresis`.
#[derive(Clone, Debug, PartialEq)]
pub struct DynamicGradScalerConfig {
    /// The scale of the first iteration (Megatron's default 2³²).
    pub initial_scale: f64,
    /// The scale never goes below this.
    pub min_scale: f64,
    /// Factor applied after `growth_interval` steps without overflow (2).
    pub growth_factor: f64,
    /// Factor applied on overflow once hysteresis is used up (0.5).
    pub backoff_factor: f64,
    /// Clean steps before growing (`--loss-scale-window`).
    pub growth_interval: u64,
    /// Overflows tolerated before backing off (`--hysteresis`).
    pub hysteresis: u64,
}

impl Default for DynamicGradScalerConfig {
    /// Megatron's defaults.
    fn default() -> Self {
        Self {
            initial_scale: 2f64.powi(32),
            min_scale: 1.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 1000,
            hysteresis: 2,
        }
    }
}

/// What a checkpoint keeps of a scaler (Megatron's `state_dict`: scale, growth tracker,
/// hysteresis tracker), so a resumed run scales exactly as the uninterrupted one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GradScalerState {
    /// Current scale.
    pub scale: f64,
    /// Clean steps since the last growth or overflow.
    pub growth_tracker: u64,
    /// Overflows left before the next back-off.
    pub hysteresis_tracker: i64,
}

/// Megatron's `DynamicGradScaler`.
#[derive(Clone, Debug, PartialEq)]
pub struct DynamicGradScaler {
    config: DynamicGradScalerConfig,
    state: GradScalerState,
}

impl DynamicGradScaler {
    /// A scaler at its initial scale.
    pub fn new(config: DynamicGradScalerConfig) -> Self {
        let state = GradScalerState {
            scale: config.initial_scale,
            growth_tracker: 0,
            hysteresis_tracker: config.hysteresis as i64,
        };
        Self { config, state }
    }

    /// Megatron's `update(found_inf)`.
    pub fn update(&mut self, found_inf: bool) {
        let (c, s) = (&self.config, &mut self.state);
        if found_inf {
            s.growth_tracker = 0;
            s.hysteresis_tracker -= 1;
            if s.hysteresis_tracker <= 0 {
                s.scale = (s.scale * c.backoff_factor).max(c.min_scale);
            }
        } else {
            s.growth_tracker += 1;
            if s.growth_tracker == c.growth_interval {
                s.growth_tracker = 0;
                s.hysteresis_tracker = c.hysteresis as i64;
                s.scale *= c.growth_factor;
            }
        }
    }
}

/// The loss scaling of a run: Megatron's `ConstantGradScaler` (`--loss-scale`) or
/// `DynamicGradScaler` (`--fp16` without `--loss-scale`). Runs without one (fp32, and bf16
/// without `--loss-scale`) neither scale nor check for overflow, as in Megatron.
#[derive(Clone, Debug, PartialEq)]
pub enum GradScaler {
    /// A fixed scale.
    Constant(f64),
    /// A scale that follows overflows.
    Dynamic(DynamicGradScaler),
}

impl GradScaler {
    /// The scale the next iteration's loss is multiplied by.
    pub fn scale(&self) -> f64 {
        match self {
            GradScaler::Constant(scale) => *scale,
            GradScaler::Dynamic(d) => d.state.scale,
        }
    }

    /// Records whether this iteration's gradients overflowed (a constant scaler ignores it).
    pub fn update(&mut self, found_inf: bool) {
        if let GradScaler::Dynamic(d) = self {
            d.update(found_inf);
        }
    }

    /// The state a checkpoint keeps.
    pub fn state(&self) -> GradScalerState {
        match self {
            GradScaler::Constant(scale) => GradScalerState {
                scale: *scale,
                growth_tracker: 0,
                hysteresis_tracker: 0,
            },
            GradScaler::Dynamic(d) => d.state.clone(),
        }
    }

    /// Restores a state saved by [`Self::state`] (a constant scaler keeps its own scale, as
    /// Megatron's does when `--loss-scale` is given again).
    pub fn load_state(&mut self, state: GradScalerState) {
        if let GradScaler::Dynamic(d) = self {
            d.state = state;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_after_hysteresis_and_grows_after_the_window() {
        let mut s = GradScaler::Dynamic(DynamicGradScaler::new(DynamicGradScalerConfig {
            initial_scale: 1024.0,
            min_scale: 256.0,
            growth_interval: 3,
            hysteresis: 2,
            ..Default::default()
        }));
        let mut scales = vec![];
        for found_inf in [
            true, true, true, false, false, false, true, true, true, true,
        ] {
            s.update(found_inf);
            scales.push(s.scale());
        }
        // 1st overflow uses up hysteresis; then each overflow halves until growth resets it;
        // the floor holds at min_scale.
        assert_eq!(
            scales,
            [1024.0, 512.0, 256.0, 256.0, 256.0, 512.0, 512.0, 256.0, 256.0, 256.0]
        );
        let mut c = GradScaler::Constant(8.0);
        c.update(true);
        assert_eq!(c.scale(), 8.0);
    }
}
