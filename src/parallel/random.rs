//! Dropout randomness that every parallel layout draws alike: dropout in the residual stream
//! (embeddings, after each layer) draws from one stream, dropout of the attention
//! probabilities from a second, and every tensor-parallel rank draws the same keys. A
//! tensor-parallel rank applies its part of a mask drawn for the whole tensor: its heads'
//! part of the attention probabilities' (each element's bits keyed by its global head), its
//! chunk of the sequence under sequence parallelism (the model's `Dropout`).
//! Megatron's `CudaRNGStatesTracker` instead seeds the attention's stream per rank
//! (`seed + 2718 + tp_rank`), so its TP=2 run drops other probabilities than its TP=1 run;
//! here every layout trains the single process's model, attention dropout on.
//!
//! Each dropout call takes the next key of its stream (seeded per layer, the draws counted
//! within it) XOR the micro-batch's salt (from the iteration and the micro-batch's place in
//! the global batch); its mask is a counter-based function of the key and the element index,
//! computed on the host for the CPU and in the kernel on GPUs, so masks are the same on every
//! backend, after a resume, under recomputation, and whatever threads run the other ranks
//! (each rank is a thread here; the state is thread-local, like Megatron's per-process
//! state). The salt enters by XOR alone so that a device launch can carry the rest of the key
//! and read the salt from device memory: a captured step then replays with any micro-batch's
//! masks (`ferrotron_kernels::launch::dropout_salt_buffer`).

use std::cell::RefCell;

/// Which stream a dropout draws from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RngRegion {
    /// The residual stream's dropouts.
    #[default]
    Replicated,
    /// The attention probabilities' dropout (a mask over every head).
    AttentionHeads,
}

/// The offset of the attention stream's seed: Megatron's model-parallel offset, at its
/// tensor-parallel rank 0 (so a TP=1 run draws Megatron's way and the masks it drew before
/// the streams stopped depending on the rank).
const ATTENTION_OFFSET: u64 = 2718;

#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
struct Tracker {
    /// The rank's streams, from which each layer's are derived.
    base: [u64; 2],
    seeds: [u64; 2],
    draws: [u64; 2],
    /// The micro-batch's salt, XORed into every key.
    salt: u64,
    /// The micro-batch's index in the global batch.
    micro_batch: u64,
}

thread_local! {
    static TRACKER: RefCell<Tracker> = RefCell::new(Tracker::default());
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Seeds this thread's streams for micro-batch `micro_batch` (its index in the global
/// batch) of one training iteration (the same on every rank of the layout).
///
/// Keying the masks by the micro-batch's place in the global batch, not by how many this
/// rank has run, gives a data-parallel run the masks the single-process run draws for the
/// same samples, so the two train the same model.
pub fn seed_micro_batch(seed: u64, iteration: u64, micro_batch: u64) {
    let step = splitmix64(iteration) ^ splitmix64(micro_batch.wrapping_add(0x5EED));
    let base = splitmix64(seed);
    let attention = splitmix64(seed.wrapping_add(ATTENTION_OFFSET));
    TRACKER.with(|t| {
        *t.borrow_mut() = Tracker {
            base: [base, attention],
            seeds: [base, attention],
            draws: [0, 0],
            salt: splitmix64(seed ^ step),
            micro_batch,
        }
    });
}

/// A micro-batch's dropout salt and where a device keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutSalt {
    /// The part of every key that changes from one micro-batch (or iteration) to the next,
    /// XORed into the rest ([`next_dropout_key`]).
    pub value: u64,
    /// The micro-batch's index in the global batch: which of the device's salt buffers its
    /// launches read (a captured step of several micro-batches reads one each).
    pub slot: u64,
}

/// The current micro-batch's salt.
pub fn dropout_salt() -> DropoutSalt {
    TRACKER.with(|t| {
        let t = t.borrow();
        DropoutSalt {
            value: t.salt,
            slot: t.micro_batch,
        }
    })
}

/// Switches this thread's streams to those of transformer layer `layer` (numbered in the
/// whole model) of the current micro-batch.
///
/// Each layer draws from streams of its own, not from where the layers before it left off,
/// so a pipeline stage that starts at layer 12 draws the masks layer 12 draws in the
/// one-stage run without running layers 0–11, and a recomputed layer re-derives its masks.
pub fn enter_layer(layer: usize) {
    let key = splitmix64(layer as u64 ^ 0x1A7E_55ED);
    TRACKER.with(|t| {
        let mut t = t.borrow_mut();
        for stream in 0..2 {
            t.seeds[stream] = splitmix64(t.base[stream] ^ key);
            t.draws[stream] = 0;
        }
    });
}

/// This thread's dropout streams at one point, to replay them (Megatron's
/// `CheckpointFunction` saves and restores the RNG states around a recomputed chunk so that
/// the recomputation draws the same masks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RngState(Tracker);

/// The current state of this thread's dropout streams.
pub fn rng_state() -> RngState {
    TRACKER.with(|t| RngState(*t.borrow()))
}

/// Puts this thread's dropout streams back to `state`.
pub fn set_rng_state(state: RngState) {
    TRACKER.with(|t| *t.borrow_mut() = state.0);
}

/// Runs `f` with the dropout streams as they were at `saved` (a recomputation), then puts
/// them back as they are now.
pub fn replaying<T>(saved: RngState, f: impl FnOnce() -> T) -> T {
    let resume = rng_state();
    set_rng_state(saved);
    let out = f();
    set_rng_state(resume);
    out
}

/// The key of the next dropout draw from `region`'s stream (advances the stream).
///
/// A draw's mask is a pure function of its key and the element index ([`dropout_bits`]), so a
/// device kernel derives it in place from the key alone (`ferrotron-kernels`' dropout), with
/// the bits the host computes here.
pub fn next_dropout_key(region: RngRegion) -> u64 {
    let stream = region as usize;
    TRACKER.with(|t| {
        let mut t = t.borrow_mut();
        t.draws[stream] += 1;
        splitmix64(t.seeds[stream] ^ splitmix64(t.draws[stream])) ^ t.salt
    })
}

/// Murmur3's 32-bit finaliser (the same as the dropout kernel's).
fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// The random bits of element `index` of the draw keyed `key`: 32-bit operations only, the
/// same function as the device kernel's.
pub fn dropout_bits(key: u64, index: u32) -> u32 {
    let (lo, hi) = (key as u32, (key >> 32) as u32);
    fmix32(fmix32(index ^ lo).wrapping_add(hi) ^ 0x9e37_79b9)
}

/// Elements whose bits are below this are dropped: `p · 2³²`.
pub fn dropout_threshold(p: f64) -> u32 {
    (p * (1u64 << 32) as f64).min(u32::MAX as f64) as u32
}

/// The multiplier mask of `n` elements of the draw keyed `key`: `1 / (1 − p)` where kept,
/// 0 where dropped (each with probability `p`).
pub fn dropout_mask_of(key: u64, n: usize, p: f64) -> Vec<f32> {
    assert!(n <= u32::MAX as usize, "dropout of more than 2³² elements");
    dropout_mask_at(key, 0..n, p)
}

/// The part of the mask of draw `key` over a tensor of shape `whole` that a tensor holding
/// some of its elements holds: along each dimension `d`, local index `i` is whole index
/// `picks[d][i]` (a chunk of the sequence, a rank's heads, a context-parallel rank's two
/// chunks). The elements' bits are those of the whole tensor's, so every layout drops alike.
pub fn dropout_mask_picked(key: u64, p: f64, whole: &[usize], picks: &[Vec<usize>]) -> Vec<f32> {
    assert!(
        whole.iter().product::<usize>() <= u32::MAX as usize,
        "dropout of more than 2³² elements"
    );
    let mut offsets = vec![0usize];
    for (pick, &size) in picks.iter().zip(whole) {
        offsets = offsets
            .iter()
            .flat_map(|&o| pick.iter().map(move |&i| o * size + i))
            .collect();
    }
    dropout_mask_at(key, offsets, p)
}

/// The mask values at whole-tensor element indices `indices`.
fn dropout_mask_at(key: u64, indices: impl IntoIterator<Item = usize>, p: f64) -> Vec<f32> {
    let threshold = dropout_threshold(p);
    let keep = (1.0 / (1.0 - p)) as f32;
    indices
        .into_iter()
        .map(|i| {
            if dropout_bits(key, i as u32) < threshold {
                0.0
            } else {
                keep
            }
        })
        .collect()
}

/// The next dropout multiplier mask of `n` elements from `region`'s stream.
pub fn dropout_mask(n: usize, p: f64, region: RngRegion) -> Vec<f32> {
    dropout_mask_of(next_dropout_key(region), n, p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_keep_the_expected_fraction_and_each_stream_its_own_keys() {
        seed_micro_batch(1234, 7, 0);
        let a = dropout_mask(100_000, 0.1, RngRegion::Replicated);
        let a_heads = dropout_mask(1000, 0.1, RngRegion::AttentionHeads);
        let kept = a.iter().filter(|&&v| v > 0.0).count() as f64 / a.len() as f64;
        assert!((kept - 0.9).abs() < 0.005, "kept {kept}");
        assert!(a.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.9).abs() < 1e-6));
        assert_ne!(a[..1000], a_heads[..]);
        // The same micro-batch again reproduces both streams' masks; another iteration does
        // not.
        seed_micro_batch(1234, 7, 0);
        assert_eq!(dropout_mask(100_000, 0.1, RngRegion::Replicated), a);
        assert_eq!(dropout_mask(1000, 0.1, RngRegion::AttentionHeads), a_heads);
        seed_micro_batch(1234, 8, 0);
        assert_ne!(dropout_mask(100_000, 0.1, RngRegion::Replicated), a);
        // Another micro-batch of the same iteration draws other masks too.
        seed_micro_batch(1234, 7, 1);
        assert_ne!(dropout_mask(100_000, 0.1, RngRegion::Replicated), a);
    }

    /// A key without its micro-batch's salt is the same in every micro-batch and iteration
    /// (what a device launch carries, fixed in a captured step), and the salt differs.
    #[test]
    fn keys_differ_across_micro_batches_by_their_salt_alone() {
        let unsalted = |iteration, micro_batch| {
            seed_micro_batch(5, iteration, micro_batch);
            enter_layer(3);
            next_dropout_key(RngRegion::Replicated);
            let second = next_dropout_key(RngRegion::AttentionHeads);
            (second ^ dropout_salt().value, dropout_salt().value)
        };
        let (a, salt_a) = unsalted(7, 0);
        let (b, salt_b) = unsalted(8, 2);
        assert_eq!(a, b);
        assert_ne!(salt_a, salt_b);
    }

    #[test]
    fn a_layer_draws_the_same_masks_whatever_ran_before_it() {
        seed_micro_batch(99, 3, 2);
        dropout_mask(1000, 0.1, RngRegion::Replicated);
        enter_layer(0);
        let layer0 = dropout_mask(1000, 0.1, RngRegion::Replicated);
        dropout_mask(1000, 0.1, RngRegion::AttentionHeads);
        enter_layer(5);
        let layer5 = dropout_mask(1000, 0.1, RngRegion::Replicated);
        let layer5_mp = dropout_mask(1000, 0.1, RngRegion::AttentionHeads);
        assert_ne!(layer0, layer5);
        // Another stage: the same micro-batch, straight to layer 5.
        seed_micro_batch(99, 3, 2);
        enter_layer(5);
        assert_eq!(dropout_mask(1000, 0.1, RngRegion::Replicated), layer5);
        assert_eq!(
            dropout_mask(1000, 0.1, RngRegion::AttentionHeads),
            layer5_mp
        );
        // Another micro-batch's layer 5 differs.
        seed_micro_batch(99, 3, 3);
        enter_layer(5);
        assert_ne!(dropout_mask(1000, 0.1, RngRegion::Replicated), layer5);
    }
}
