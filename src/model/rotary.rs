//! Rotary position embeddings (RoFormer; Megatron's `RotaryEmbedding` and
//! `apply_rotary_pos_emb`): each pair of a head's first `rotary_dim` channels is rotated by
//! its position times the pair's frequency, so that the score of a query and a key depends on
//! their distance only.
//!
//! On a CubeCL device the rotation is one fused kernel ([`super::fused::rotary`]), forward
//! and backward (the rotation by the negative angle); elsewhere, or with fusion off, it is
//! composed of burn ops. Both take their angles from the same float64 tables.

use std::sync::{Arc, Mutex};

use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use super::GptConfig;

/// The frequencies of one model's rotary embedding; no parameters.
#[derive(Clone, Debug)]
pub struct RotaryEmbedding {
    /// One inverse frequency per rotated pair, `base^(−2i / rotary_dim)` (Llama 3.1's
    /// scaling applied).
    inv_freq: Vec<f64>,
    /// Pairs are (2i, 2i+1) instead of (i, i + rotary_dim / 2).
    interleaved: bool,
    /// What the `cos` and `sin` tables are multiplied by: YaRN's concentration, else 1.
    table_scale: f64,
    /// Use the fused kernel where the backend has it; follows the norms' fusion switch
    /// (`--no-persist-layer-norm` turns it off), the math is the same.
    fused: bool,
    /// The last angle tables built, kept: every micro-batch of every step asks for the same
    /// positions, and building them (a cosine and a sine in float64 per position and pair)
    /// then uploading them took host time on each layer's every call.
    tables: Arc<Mutex<Option<PairTables>>>,
}

/// Angle tables for `len` positions from `start` on `device`.
#[derive(Clone, Debug)]
struct PairTables {
    start: usize,
    len: usize,
    device: Device,
    cos_sin: [Tensor<2>; 2],
}

/// Two embeddings are equal when they rotate alike (their table caches aside).
impl PartialEq for RotaryEmbedding {
    fn eq(&self, other: &Self) -> bool {
        self.inv_freq == other.inv_freq
            && self.interleaved == other.interleaved
            && self.table_scale == other.table_scale
            && self.fused == other.fused
    }
}

impl RotaryEmbedding {
    /// The rotary embedding `config` asks for.
    pub fn new(config: &GptConfig) -> Self {
        let dim = config.rotary_dim();
        let inv_freq = match &config.yarn {
            Some(yarn) => yarn.inverse_frequencies(config.rotary_base, dim),
            None => (0..dim / 2)
                .map(|i| {
                    let f = config.rotary_base.powf(-((2 * i) as f64) / dim as f64);
                    config.rope_scaling.as_ref().map_or(f, |s| s.apply(f))
                })
                .collect(),
        };
        Self {
            inv_freq,
            interleaved: config.rotary_interleaved,
            table_scale: config.yarn.as_ref().map_or(1.0, |y| y.concentration()),
            fused: config.rope_fusion,
            tables: Arc::default(),
        }
    }

    /// The same embedding, with the fused kernel allowed or not.
    pub fn with_fusion(mut self, fused: bool) -> Self {
        self.fused = fused;
        self
    }

    /// Channels rotated per head.
    fn dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// `cos` and `sin` of every rotated pair's angle at positions `start..start + len`,
    /// `[len, rotary_dim / 2]` each, on `device` (angles in float64, values in f32); the
    /// last ones built are kept and handed out again for the same positions and device.
    fn pair_tables(&self, start: usize, len: usize, device: &Device) -> [Tensor<2>; 2] {
        let mut cached = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = cached.as_ref() {
            if (t.start, t.len) == (start, len) && &t.device == device {
                return t.cos_sin.clone();
            }
        }
        let cos_sin = self.build_pair_tables(start, len, device);
        *cached = Some(PairTables {
            start,
            len,
            device: device.clone(),
            cos_sin: cos_sin.clone(),
        });
        cos_sin
    }

    /// [`Self::pair_tables`] computed.
    fn build_pair_tables(&self, start: usize, len: usize, device: &Device) -> [Tensor<2>; 2] {
        let pairs = self.inv_freq.len();
        let (mut cos, mut sin) = (
            Vec::with_capacity(len * pairs),
            Vec::with_capacity(len * pairs),
        );
        for position in start..start + len {
            for theta in &self.inv_freq {
                let angle = position as f64 * theta;
                cos.push((angle.cos() * self.table_scale) as f32);
                sin.push((angle.sin() * self.table_scale) as f32);
            }
        }
        [cos, sin].map(|v| Tensor::<2>::from_data(TensorData::new(v, [len, pairs]), device))
    }

    /// A pair table `[len, rotary_dim / 2]` spread over the channels of each pair,
    /// `[1, 1, len, rotary_dim]` in `dtype`: pair i at channels 2i and 2i+1 (interleaved), or
    /// at i and i + rotary_dim / 2.
    fn channel_table(&self, pairs: Tensor<2>, dtype: DType) -> Tensor<4> {
        let [len, half] = pairs.dims();
        let channels = if self.interleaved {
            pairs
                .unsqueeze_dim::<3>(2)
                .repeat_dim(2, 2)
                .reshape([len, 2 * half])
        } else {
            Tensor::cat(vec![pairs.clone(), pairs], 1)
        };
        channels.cast(dtype).unsqueeze::<4>()
    }

    /// `x` `[batch, heads, seq, head_dim]` at positions `start..start + seq`, rotated:
    /// `x·cos + rotate(x)·sin` on the first `rotary_dim` channels, the rest passed through.
    pub fn apply(&self, x: Tensor<4>, start: usize) -> Tensor<4> {
        let [x] = self.apply_to([x], start);
        x
    }

    /// Whether the rotation runs as the fused kernel on a CubeCL device (then the attention op
    /// from the QKV rows can run it inside, [`Self::for_rows`]).
    pub fn is_fused(&self) -> bool {
        self.fused && self.dim() > 0
    }

    /// The rotation the attention op from the QKV rows applies inside, at positions
    /// `0..seq` on `device` (the same float64 angle tables as [`Self::apply`]); `None` with
    /// the fused kernel off or nothing to rotate.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    pub fn for_rows(&self, seq: usize, device: &Device) -> Option<super::fused::RowRotation> {
        (self.is_fused() && seq > 0).then(|| {
            let [cos, sin] = self.pair_tables(0, seq, device);
            super::fused::RowRotation {
                cos,
                sin,
                interleaved: self.interleaved,
            }
        })
    }

    /// [`Self::apply`] to tensors at the same positions (a layer's queries and keys), with
    /// one set of angle tables.
    pub fn apply_to<const N: usize>(&self, xs: [Tensor<4>; N], start: usize) -> [Tensor<4>; N] {
        let Some(first) = xs.first() else {
            return xs;
        };
        let (s, dtype, device) = (first.dims()[2], first.dtype(), first.device());
        let [cos, sin] = self.pair_tables(start, s, &device);
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if self.fused && self.dim() > 0 && s > 0 && crate::util::device::is_cube(&device) {
            return xs
                .map(|x| super::fused::rotary(x, cos.clone(), sin.clone(), 0, self.interleaved));
        }
        let _ = self.fused;
        let (cos, sin) = (
            self.channel_table(cos, dtype),
            self.channel_table(sin, dtype),
        );
        xs.map(|x| self.rotate_composed(x, &cos, &sin))
    }

    /// [`Self::apply_to`] at each token's own position, `positions` `[batch, seq]` (packed
    /// documents under `--reset-position-ids`): the angle tables' rows gathered per token.
    /// Composed of burn ops on every device (the fused kernel takes one run of positions).
    pub fn apply_at<const N: usize>(
        &self,
        xs: [Tensor<4>; N],
        positions: &Tensor<2, Int>,
        whole_seq: usize,
    ) -> [Tensor<4>; N] {
        let Some(first) = xs.first() else {
            return xs;
        };
        let (s, dtype, device) = (first.dims()[2], first.dtype(), first.device());
        let [b, _] = positions.dims();
        // A position is at most its token's index in the whole sequence (`whole_seq` long; a
        // context-parallel rank holds `s` of its tokens), so the tables of 0..whole_seq hold
        // every one.
        let [cos, sin] = self.pair_tables(0, whole_seq, &device);
        let rows = positions.clone().reshape([b * s]);
        let per_token = |pairs: Tensor<2>| {
            self.channel_table(pairs.select(0, rows.clone()), dtype)
                .reshape([b, 1, s, self.dim()])
        };
        let (cos, sin) = (per_token(cos), per_token(sin));
        xs.map(|x| self.rotate_composed(x, &cos, &sin))
    }

    /// The composed rotation of `x` with channel tables `cos` and `sin`.
    fn rotate_composed(&self, x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
        let (r, d) = (self.dim(), x.dims()[3]);
        let rotated = x.clone().narrow(3, 0, r);
        let turned = self.rotate(rotated.clone());
        let out = rotated * cos.clone() + turned * sin.clone();
        if r == d {
            out
        } else {
            Tensor::cat(vec![out, x.narrow(3, r, d - r)], 3)
        }
    }

    /// Each pair `(a, b)` of the last dimension turned a quarter: `(−b, a)`.
    fn rotate(&self, x: Tensor<4>) -> Tensor<4> {
        let [b, h, s, r] = x.dims();
        if self.interleaved {
            let pairs = x.reshape([b, h, s, r / 2, 2]);
            let (even, odd) = (pairs.clone().narrow(4, 0, 1), pairs.narrow(4, 1, 1));
            Tensor::cat(vec![odd.neg(), even], 4).reshape([b, h, s, r])
        } else {
            let (first, second) = (x.clone().narrow(3, 0, r / 2), x.narrow(3, r / 2, r / 2));
            Tensor::cat(vec![second.neg(), first], 3)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::architecture::{PositionEmbedding, RopeScaling};
    use burn::tensor::Device;

    fn config(interleaved: bool, percent: f64) -> GptConfig {
        GptConfig::new(1, 16, 2, 32, 64)
            .with_position_embedding_type(PositionEmbedding::Rope)
            .with_rotary_interleaved(interleaved)
            .with_rotary_percent(percent)
    }

    /// The rotation in float64 by hand: pair (i, i + r/2) (or (2i, 2i+1)) of channel vector
    /// `v` at position `p` turned by angle p·θ_i.
    fn rotate_by_hand(v: &[f64], p: usize, theta: &[f64], interleaved: bool) -> Vec<f64> {
        let r = 2 * theta.len();
        let mut out = v.to_vec();
        for (i, t) in theta.iter().enumerate() {
            let (a, b) = if interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + r / 2)
            };
            let (c, s) = ((p as f64 * t).cos(), (p as f64 * t).sin());
            out[a] = v[a] * c - v[b] * s;
            out[b] = v[b] * c + v[a] * s;
        }
        out
    }

    #[test]
    fn rotates_each_pair_by_its_angle() {
        let device = Device::flex();
        for (interleaved, percent) in [(false, 1.0), (true, 1.0), (false, 0.5)] {
            let rope = RotaryEmbedding::new(&config(interleaved, percent));
            let r = rope.dim();
            assert_eq!(r, (8.0 * percent) as usize);
            let values: Vec<f32> = (0..3 * 8).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
            let x = Tensor::<4>::from_data(TensorData::new(values.clone(), [1, 1, 3, 8]), &device);
            let got: Vec<f32> = rope.apply(x, 5).into_data().try_to_vec().unwrap();
            for s in 0..3 {
                let v: Vec<f64> = values[s * 8..s * 8 + 8].iter().map(|&x| x as f64).collect();
                let want = rotate_by_hand(&v, 5 + s, &rope.inv_freq, interleaved);
                for c in 0..8 {
                    assert!((got[s * 8 + c] as f64 - want[c]).abs() < 1e-5, "{s} {c}");
                }
            }
        }
    }

    /// Under YaRN each pair turns by YaRN's frequency (Megatron-Core's, checked in
    /// tests/sliding_window.rs) and the rotated vector is scaled by its concentration, on the
    /// composed path and in the tables the fused kernel reads.
    #[test]
    fn yarn_turns_by_its_frequencies_and_scales_by_its_concentration() {
        let device = Device::flex();
        let yarn = crate::model::YarnScaling {
            factor: 4.0,
            original_max_position_embeddings: 16.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 0.0,
            round_to_int: true,
        };
        let rope = RotaryEmbedding::new(&config(false, 1.0).with_yarn(Some(yarn)));
        let theta = yarn.inverse_frequencies(10000.0, 8);
        assert_eq!(rope.inv_freq, theta);
        let scale = yarn.concentration();
        assert!(scale > 1.1, "{scale}");
        let values: Vec<f32> = (0..3 * 8).map(|i| ((i * 5) % 9) as f32 - 4.0).collect();
        let x = Tensor::<4>::from_data(TensorData::new(values.clone(), [1, 1, 3, 8]), &device);
        let got: Vec<f32> = rope.apply(x, 7).into_data().try_to_vec().unwrap();
        for s in 0..3 {
            let v: Vec<f64> = values[s * 8..s * 8 + 8].iter().map(|&x| x as f64).collect();
            let want = rotate_by_hand(&v, 7 + s, &theta, false);
            for c in 0..8 {
                let w = want[c] * scale;
                assert!((got[s * 8 + c] as f64 - w).abs() < 1e-5, "{s} {c}");
            }
        }
    }

    /// The kept tables are those of the positions asked for: the same positions again give
    /// the same tables, other positions their own.
    #[test]
    fn angle_tables_are_kept_per_positions() {
        let device = Device::flex();
        let rope = RotaryEmbedding::new(&config(false, 1.0));
        let values = |t: [Tensor<2>; 2]| t.map(|t| t.into_data().try_to_vec::<f32>().unwrap());
        for (start, len) in [(0, 4), (0, 4), (3, 4), (0, 4), (0, 6)] {
            let got = values(rope.pair_tables(start, len, &device));
            let want = values(rope.build_pair_tables(start, len, &device));
            assert_eq!(got, want, "positions {start}..+{len}");
        }
        // Equality ignores what is kept.
        assert_eq!(rope, RotaryEmbedding::new(&config(false, 1.0)));
    }

    #[test]
    fn llama3_scaling_keeps_high_and_slows_low_frequencies() {
        let scaling = RopeScaling {
            original_max_position_embeddings: 16.0,
            ..RopeScaling::llama3(8.0)
        };
        // Wavelength 2π/θ: under 4 kept, over 16 divided by 8, between blended.
        assert_eq!(scaling.apply(2.0), 2.0);
        assert!((scaling.apply(0.1) - 0.1 / 8.0).abs() < 1e-15);
        let mid = 2.0 * std::f64::consts::PI / 8.0; // wavelength 8: smooth = (2 − 1) / 3
        let want = (1.0 - 1.0 / 3.0) * mid / 8.0 + mid / 3.0;
        assert!((scaling.apply(mid) - want).abs() < 1e-15);
    }
}
