//! With the `cpu` feature, the test and bench executables export `__truncsfbf2`
//! (`src/cpu_runtime.rs`) so that cubecl-cpu's JIT can link bf16 kernels against it.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let x86_64 = std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64");
    if std::env::var_os("CARGO_FEATURE_CPU").is_some() && x86_64 {
        for target in ["tests", "benches"] {
            println!(
                "cargo:rustc-link-arg-{target}=-Wl,--undefined=__truncsfbf2,--export-dynamic-symbol=__truncsfbf2"
            );
        }
    }
}
