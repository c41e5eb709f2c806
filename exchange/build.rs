//! Compiles the protocol's one .proto file with a pure-Rust compiler (no system `protoc`).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/flightshuffle.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    // `Storage` carries credentials: its Debug (in `storage.rs`) prints no option value.
    prost_build::Config::new()
        .skip_debug(["flightshuffle.Storage"])
        .compile_fds(fds)?;
    Ok(())
}
