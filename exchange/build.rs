//! Compiles the protocol's one .proto file with a pure-Rust compiler (no system `protoc`).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/flightshuffle.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
