//! numpy's legacy `RandomState` (MT19937), enough of it to shuffle exactly as Megatron does.
//!
//! Megatron builds its GPT dataset indices with `numpy.random.RandomState(seed).shuffle(...)`.
//! Reproducing that generator bit for bit means ferrotron visits the same samples in the same
//! order as Megatron for the same `--seed`, which makes runs comparable across the two.

/// The Mersenne Twister MT19937, seeded like `numpy.random.RandomState(seed)`.
#[derive(Clone)]
pub struct NumpyRandomState {
    state: [u32; 624],
    index: usize,
}

impl std::fmt::Debug for NumpyRandomState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NumpyRandomState")
            .field("index", &self.index)
            .finish()
    }
}

impl NumpyRandomState {
    /// `RandomState(seed)` for an integer seed (numpy uses MT19937's `init_genrand`).
    pub fn new(seed: u32) -> Self {
        let mut state = [0u32; 624];
        state[0] = seed;
        for i in 1..624 {
            let prev = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Self { state, index: 624 }
    }

    fn twist(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        for i in 0..624 {
            let y = (self.state[i] & UPPER) | (self.state[(i + 1) % 624] & LOWER);
            let mut next = self.state[(i + 397) % 624] ^ (y >> 1);
            if y & 1 != 0 {
                next ^= 0x9908_b0df;
            }
            self.state[i] = next;
        }
        self.index = 0;
    }

    /// The next 32-bit output (`genrand_int32`).
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    fn next_u64(&mut self) -> u64 {
        let hi = self.next_u32() as u64;
        (hi << 32) | self.next_u32() as u64
    }

    /// A uniform integer in `0..=max` by masked rejection (numpy's `random_interval`).
    pub fn interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        for shift in [1, 2, 4, 8, 16, 32] {
            mask |= mask >> shift;
        }
        if max <= u32::MAX as u64 {
            loop {
                let v = (self.next_u32() as u64) & mask;
                if v <= max {
                    return v;
                }
            }
        }
        loop {
            let v = self.next_u64() & mask;
            if v <= max {
                return v;
            }
        }
    }

    /// A uniform float in [0, 1) with 53 random bits (numpy's `random_sample`).
    pub fn random_sample(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67_108_864.0 + b) / 9_007_199_254_740_992.0
    }

    /// Shuffles in place exactly like `RandomState.shuffle` on a 1-D array.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.interval(i as u64) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_mt19937_and_numpy() {
        // Matsumoto & Nishimura's reference: init_genrand(5489) starts 3499211612, 581869302.
        let mut mt = NumpyRandomState::new(5489);
        assert_eq!(mt.next_u32(), 3_499_211_612);
        assert_eq!(mt.next_u32(), 581_869_302);
        // numpy 2.x: a = np.arange(10); np.random.RandomState(1234).shuffle(a)
        let mut a: Vec<u32> = (0..10).collect();
        NumpyRandomState::new(1234).shuffle(&mut a);
        assert_eq!(a, [7, 2, 9, 1, 0, 8, 4, 5, 6, 3]);
        // numpy 2.x: r = np.random.RandomState(1234); r.random_sample(), r.random_sample()
        let mut r = NumpyRandomState::new(1234);
        assert_eq!(r.random_sample(), 0.1915194503788923);
        assert_eq!(r.random_sample(), 0.6221087710398319);
    }
}
