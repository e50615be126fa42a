// Generated at build time with protoc (the README's commands install Debian's
// protobuf-compiler), so the .proto is the only source of truth.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        .compile_protos(&["proto/tessera/hook/v1/hook.proto"], &["proto"])?;
    Ok(())
}
