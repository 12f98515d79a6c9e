//! Run-time support the cubecl-cpu JIT needs from the process that runs its kernels.
//!
//! LLVM lowers `fptrunc float to bfloat` to a call of `__truncsfbf2` on x86-64 CPUs without
//! AVX512-BF16 / AVX-NE-CONVERT (the JIT compiles for the host CPU). Neither Debian 12's
//! libgcc (GCC 12) nor Rust's compiler-builtins provide it, so on such a CPU a bf16 kernel
//! fails to link in the JIT ("Symbols not found: [ __truncsfbf2 ]"). It is defined here, and
//! the crate's build script exports it from its test and bench executables, where the JIT's
//! process-symbol lookup finds it.

/// f32 → bf16 rounding to nearest even (NaN stays NaN), as compiler-rt's `__truncsfbf2`.
/// The x86-64 calling convention returns a `__bf16` in the low 16 bits of `xmm0`, which is
/// where an `f32` return value's low bits go.
#[cfg(target_arch = "x86_64")]
#[no_mangle]
pub extern "C" fn __truncsfbf2(x: f32) -> f32 {
    f32::from_bits(u32::from(half::bf16::from_f32(x).to_bits()))
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    #[test]
    fn rounds_as_the_half_crate_and_keeps_the_bits_low() {
        for x in [
            1.0f32,
            -2.5,
            1.0 + 1.0 / 256.0,
            3.0e38,
            f32::INFINITY,
            1e-40,
        ] {
            let bits = super::__truncsfbf2(x).to_bits();
            assert_eq!(bits >> 16, 0);
            assert_eq!(bits as u16, half::bf16::from_f32(x).to_bits());
        }
        assert!(half::bf16::from_bits(super::__truncsfbf2(f32::NAN).to_bits() as u16).is_nan());
    }
}
