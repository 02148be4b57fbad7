//! Builds the UCX shim of the `rdma` feature (`src/backend/rdma/shim.c`) against the system
//! UCX (`pkg-config ucx`, Debian `libucx-dev`). Without the feature it does nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "rdma")]
    rdma();
}

#[cfg(feature = "rdma")]
fn rdma() {
    println!("cargo:rerun-if-changed=src/backend/rdma/shim.c");
    let ucx = match pkg_config::Config::new()
        .atleast_version("1.10")
        .cargo_metadata(false)
        .probe("ucx")
    {
        Ok(l) => l,
        Err(e) => panic!(
            "the rdma feature needs UCX >= 1.10 with its pkg-config file \
             (Debian: apt-get install libucx-dev): {e}"
        ),
    };
    let mut build = cc::Build::new();
    build.file("src/backend/rdma/shim.c").warnings(true);
    for dir in &ucx.include_paths {
        build.include(dir);
    }
    build.compile("duet_ucx_shim");
    // The shim calls into libucp and libucs: link them after it.
    for dir in &ucx.link_paths {
        println!("cargo:rustc-link-search=native={}", dir.display());
    }
    for lib in ucx.libs.iter().map(String::as_str).chain(["ucs"]) {
        println!("cargo:rustc-link-lib={lib}");
    }
}
