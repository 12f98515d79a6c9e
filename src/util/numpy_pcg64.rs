//! numpy's `default_rng(seed)` (a `PCG64` bit generator seeded through `SeedSequence`) and the
//! `integers` draw of bounded 32-bit integers: what Megatron-Core's `MockGPTLowLevelDataset`
//! uses for its document lengths, reproduced so that `--mock-data` serves Megatron's samples.
//!
//! The algorithms are numpy's (`bit_generator.pyx`'s `SeedSequence`, `pcg64.h`'s XSL-RR
//! 128/64 generator, `distributions.c`'s Lemire bounded draw); the unit test checks them
//! against numpy's own output.

/// `SeedSequence`'s hashing constants.
const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const XSHIFT: u32 = 16;
/// PCG's 128-bit LCG multiplier.
const PCG_MULTIPLIER: u128 = (2_549_297_995_355_413_924u128 << 64) | 4_865_540_595_714_422_341;

/// `numpy.random.default_rng(seed)` for a non-negative integer seed below 2³².
pub struct NumpyPcg64 {
    state: u128,
    increment: u128,
    /// The unused high half of the last 64-bit output (numpy's `has_uint32`/`uinteger`).
    buffered: Option<u32>,
}

impl NumpyPcg64 {
    /// The generator `default_rng(seed)` returns.
    pub fn new(seed: u32) -> Self {
        let words = seed_sequence_state(seed, 8);
        let word64 = |i: usize| (words[2 * i] as u64) | ((words[2 * i + 1] as u64) << 32);
        let initstate = ((word64(0) as u128) << 64) | word64(1) as u128;
        let initseq = ((word64(2) as u128) << 64) | word64(3) as u128;
        let mut rng = Self {
            state: 0,
            increment: (initseq << 1) | 1,
            buffered: None,
        };
        rng.step();
        rng.state = rng.state.wrapping_add(initstate);
        rng.step();
        rng
    }

    fn step(&mut self) {
        self.state = self
            .state
            .wrapping_mul(PCG_MULTIPLIER)
            .wrapping_add(self.increment);
    }

    /// The next 64-bit output (XSL-RR of the advanced state).
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let folded = ((self.state >> 64) as u64) ^ (self.state as u64);
        folded.rotate_right((self.state >> 122) as u32)
    }

    /// The next 32-bit output: the low half of a 64-bit one, then its high half.
    pub fn next_u32(&mut self) -> u32 {
        if let Some(high) = self.buffered.take() {
            return high;
        }
        let next = self.next_u64();
        self.buffered = Some((next >> 32) as u32);
        next as u32
    }

    /// `integers(low, high, dtype=np.int32)`: uniform in `[low, high)` by Lemire's method.
    pub fn integer_i32(&mut self, low: i32, high: i32) -> i32 {
        let range = (high as i64 - low as i64) as u64;
        assert!(
            range > 0 && range <= u32::MAX as u64,
            "empty or too wide a range"
        );
        let excluded = range as u32;
        let mut m = self.next_u32() as u64 * excluded as u64;
        if (m as u32) < excluded {
            let threshold = excluded.wrapping_neg() % excluded;
            while (m as u32) < threshold {
                m = self.next_u32() as u64 * excluded as u64;
            }
        }
        (low as i64 + (m >> 32) as i64) as i32
    }
}

/// `SeedSequence(seed).generate_state(words, np.uint32)`.
fn seed_sequence_state(seed: u32, words: usize) -> Vec<u32> {
    let mut hash_const = INIT_A;
    let mut hashmix = |value: u32| {
        let mut value = value ^ hash_const;
        hash_const = hash_const.wrapping_mul(MULT_A);
        value = value.wrapping_mul(hash_const);
        value ^ (value >> XSHIFT)
    };
    let mix = |x: u32, y: u32| {
        let result = MIX_MULT_L
            .wrapping_mul(x)
            .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
        result ^ (result >> XSHIFT)
    };
    // The pool of four words from the entropy [seed] (zeros after it).
    let mut pool = [0u32; 4];
    for (i, word) in pool.iter_mut().enumerate() {
        *word = hashmix(if i == 0 { seed } else { 0 });
    }
    for src in 0..4 {
        for dst in 0..4 {
            if src != dst {
                let hashed = hashmix(pool[src]);
                pool[dst] = mix(pool[dst], hashed);
            }
        }
    }
    let mut hash_const = INIT_B;
    (0..words)
        .map(|i| {
            let mut value = pool[i % 4] ^ hash_const;
            hash_const = hash_const.wrapping_mul(MULT_B);
            value = value.wrapping_mul(hash_const);
            value ^ (value >> XSHIFT)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// numpy 2's `default_rng(0)`: its state (`bit_generator.state`) and
    /// `integers(1, 4096, size=100000, dtype=np.int32)` (the first values, the sum, and a
    /// position-weighted checksum of all of them).
    #[test]
    fn matches_numpy_default_rng() {
        let rng = NumpyPcg64::new(0);
        assert_eq!(rng.state, 35399562948360463058890781895381311971);
        assert_eq!(rng.increment, 87136372517582989555478159403783844777);
        let mut rng = NumpyPcg64::new(0);
        let draws: Vec<i64> = (0..100_000)
            .map(|_| rng.integer_i32(1, 4096) as i64)
            .collect();
        assert_eq!(draws[..8], [3484, 2609, 2094, 1105, 1261, 168, 309, 68]);
        assert_eq!(draws.iter().sum::<i64>(), 204637097);
        let weighted = draws.iter().enumerate().fold(0i128, |acc, (i, &d)| {
            (acc + i as i128 * d as i128) % ((1 << 61) - 1)
        });
        assert_eq!(weighted, 10235325438683);
    }
}
