//! Generates the `duet.v1` messages and services (client and server) plus a
//! file descriptor set for gRPC server reflection. Needs `protoc` (Debian
//! `protobuf-compiler`, installed by `scripts/install-test-deps.sh`).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("duet_v1_descriptor.bin"))
        .compile_protos(
            &[
                "duet/v1/generation.proto",
                "duet/v1/worker.proto",
                "duet/v1/cluster.proto",
            ],
            &["."],
        )?;
    println!("cargo:rerun-if-changed=duet");
    Ok(())
}
