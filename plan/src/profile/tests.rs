use super::*;

/// A small hand profile with round numbers: prefill 1 ms per token, decode steps of
/// 10 ms + 1 ms per sequence, 1 GB/s links with 1 ms latency, 1 ms router overhead.
pub(crate) fn example_file() -> ProfileFile {
    ProfileFile {
        schema: SCHEMA.into(),
        source: Source {
            kind: "hand".into(),
            model: "test".into(),
            engine: "test".into(),
            machine: "test".into(),
            created_unix_s: 0.0,
            notes: vec![],
        },
        threads: 2,
        n_layers: 10,
        block_size: 16,
        kv_bytes_per_token: 1000,
        kv_pool_blocks: 1000,
        prefill: PrefillTable {
            tokens: vec![100.0, 1000.0],
            cached: vec![0.0],
            seconds: vec![vec![0.1, 1.0]],
        },
        decode_step: DecodeTable {
            batch: vec![1.0, 11.0],
            context: vec![0.0],
            seconds: vec![vec![0.011, 0.021]],
        },
        links: vec![Link {
            backend: "tcp".into(),
            bytes_per_s: 1e9,
            latency_s: 0.001,
        }],
        router_overhead_s: 0.001,
    }
}

pub(crate) fn example() -> Profile {
    Profile::new("example", example_file()).unwrap()
}

#[test]
fn costs_follow_the_tables_and_the_step_model() {
    let p = example();
    assert!((p.prefill_s(500, 0.0) - 0.5).abs() < 1e-12);
    assert!((p.step_s(6, 0.0, &[]) - 0.016).abs() < 1e-12);
    // A mixed step pays the fixed part once: 16 ms + 500 ms - 11 ms.
    assert!((p.step_s(6, 0.0, &[(500, 0.0)]) - 0.505).abs() < 1e-12);
    // Two prompts of 500: each alone, the fixed part once (not one 1000-token prompt).
    assert!((p.step_s(0, 0.0, &[(500, 0.0), (500, 0.0)]) - 0.989).abs() < 1e-12);
    assert_eq!(p.step_s(0, 0.0, &[]), 0.0);
}

#[test]
fn profiles_round_trip_through_json() {
    let text = serde_json::to_string(&example_file()).unwrap();
    let p = Profile::from_json("x.json", &text).unwrap();
    assert_eq!(p.file, example_file());
}

#[test]
fn bad_profiles_are_refused_with_the_field_named() {
    let refuse = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v = serde_json::to_value(example_file()).unwrap();
        edit(&mut v);
        Profile::from_json("gpu.json", &v.to_string())
            .unwrap_err()
            .to_string()
    };
    let e = refuse(&|v| v["schema"] = "duet-profile/9".into());
    assert!(e.contains("gpu.json: schema: unknown version"), "{e}");
    let e = refuse(&|v| {
        v.as_object_mut().unwrap().remove("decode_step");
    });
    assert!(e.contains("decode_step"), "{e}");
    let e = refuse(&|v| v["prefill"]["seconds"][0][1] = (-1.0).into());
    assert!(e.contains("gpu.json: prefill: seconds[0][1]"), "{e}");
    let e = refuse(&|v| v["links"][0]["bytes_per_s"] = 0.0.into());
    assert!(e.contains("links[0].bytes_per_s"), "{e}");
    let e = refuse(&|v| v["links"] = serde_json::json!([]));
    assert!(e.contains("links: at least one"), "{e}");
    let e = Profile::from_json("gpu.json", "{\n\"schema\": ")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("gpu.json:2"), "{e}");
}

#[test]
fn links_are_found_by_backend() {
    let p = example();
    assert_eq!(p.link(None).unwrap().backend, "tcp");
    assert!(p
        .link(Some("rdma"))
        .unwrap_err()
        .to_string()
        .contains("has tcp"));
}
