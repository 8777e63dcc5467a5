//! Seeded random numbers and weight initialisation.

/// A small seeded generator (SplitMix64): reproducible runs need nothing more.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// The generator's state: `Rng::new(r.state())` continues where `r`
    /// stands (a checkpoint keeps it).
    pub fn state(&self) -> u64 {
        self.0
    }
    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = (self.uniform() as f64).max(1e-12);
        let u2 = self.uniform() as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
    /// Uniform integer below `n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// How to draw a layer's initial weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// Normal with std sqrt(2 / fan_in) (He et al.): for ReLU-family layers.
    Kaiming,
    /// Uniform in +-sqrt(6 / (fan_in + fan_out)) (Glorot and Bengio): for
    /// sigmoid/tanh/identity layers.
    Xavier,
}

/// A plain row-major `[fan_out][fan_in]` weight matrix.
pub fn weights(init: Init, fan_out: usize, fan_in: usize, rng: &mut Rng) -> Vec<f32> {
    match init {
        Init::Kaiming => {
            let std = (2.0 / fan_in as f32).sqrt();
            (0..fan_out * fan_in).map(|_| std * rng.normal()).collect()
        }
        Init::Xavier => {
            let lim = (6.0 / (fan_in + fan_out) as f32).sqrt();
            (0..fan_out * fan_in)
                .map(|_| lim * (2.0 * rng.uniform() - 1.0))
                .collect()
        }
    }
}
