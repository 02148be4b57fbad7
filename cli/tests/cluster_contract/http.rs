//! The HTTP door (OpenAI API) of `duet up`: one test per bad request, against the shared
//! cluster.

use super::*;

/// POSTs `body` to `path` with `headers`; the reply must have `status`, OpenAI's error
/// shape, and name `param` (or mention it in the message).
fn expect_http_error(
    case: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    status: u16,
    param: &str,
) -> serde_json::Value {
    let url = format!("{}{path}", http_url());
    let r = support::http_raw("POST", &url, headers, Some(body));
    eprintln!("{case}: {} {}", r.status, r.body);
    assert_eq!(r.status, status, "{case}: {}", r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body)
        .unwrap_or_else(|e| panic!("{case}: not JSON ({e}): {}", r.body));
    let err = &v["error"];
    let message = err["message"]
        .as_str()
        .unwrap_or_else(|| panic!("{case}: {v}"));
    assert!(err["type"].is_string(), "{case}: {v}");
    assert_eq!(err["code"].as_u64(), Some(u64::from(status)), "{case}: {v}");
    assert!(
        err["param"].as_str() == Some(param) || message.contains(param),
        "{case}: the error should name {param:?}: {v}"
    );
    v
}

const JSON: (&str, &str) = ("Content-Type", "application/json");

/// One `#[test]` per bad HTTP body:
/// `name: path, body => status, "param it names";` (JSON content type).
macro_rules! bad_http_bodies {
    ($($name:ident: $path:literal, $body:expr => $status:literal, $param:literal;)*) => {
        $(
            #[test]
            fn $name() {
                let body: String = $body.to_string();
                expect_http_error(stringify!($name), $path, &[JSON], body.as_bytes(), $status, $param);
            }
        )*
    };
}

bad_http_bodies! {
    http_malformed_json: "/v1/completions", r#"{"prompt": "Hi", "max_tokens": 2"# => 400, "body";
    http_wrong_type_for_a_field: "/v1/completions", r#"{"prompt": "Hi", "max_tokens": "two"}"# => 400, "body";
    http_missing_prompt: "/v1/completions", r#"{"max_tokens": 2}"# => 400, "prompt";
    http_empty_prompt: "/v1/completions", r#"{"prompt": "", "max_tokens": 2}"# => 400, "prompt";
    http_whitespace_prompt: "/v1/completions", r#"{"prompt": "   ", "max_tokens": 2}"# => 400, "prompt";
    http_token_ids_outside_vocabulary: "/v1/completions", r#"{"prompt": [504, 999999], "max_tokens": 2}"# => 400, "prompt";
    http_prompt_longer_than_context: "/v1/completions",
        format!(r#"{{"prompt": {:?}, "max_tokens": 2}}"#, vec![504u32; 1100]) => 400, "prompt";
    http_max_tokens_zero: "/v1/completions", r#"{"prompt": "Hi", "max_tokens": 0}"# => 400, "max_tokens";
    http_max_tokens_negative: "/v1/completions", r#"{"prompt": "Hi", "max_tokens": -5}"# => 400, "max_tokens";
    http_max_tokens_above_context: "/v1/completions", r#"{"prompt": "Hi", "max_tokens": 100000}"# => 400, "max_tokens";
    http_negative_temperature: "/v1/completions", r#"{"prompt": "Hi", "temperature": -0.5}"# => 400, "temperature";
    http_top_p_zero: "/v1/completions", r#"{"prompt": "Hi", "top_p": 0}"# => 400, "top_p";
    http_top_p_above_one: "/v1/completions", r#"{"prompt": "Hi", "top_p": 1.5}"# => 400, "top_p";
    http_top_k_below_minus_one: "/v1/completions", r#"{"prompt": "Hi", "top_k": -2}"# => 400, "top_k";
    http_five_stop_sequences: "/v1/completions",
        r#"{"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}"# => 400, "stop";
    http_empty_stop_sequence: "/v1/completions", r#"{"prompt": "Hi", "stop": [""]}"# => 400, "stop";
    http_n_above_one: "/v1/completions", r#"{"prompt": "Hi", "n": 2}"# => 400, "n";
    http_attention_window_of_zero: "/v1/completions",
        r#"{"prompt": "Hi", "attention": "window=0,sinks=4"}"# => 400, "attention";
    http_attention_window_wider_than_context: "/v1/completions",
        r#"{"prompt": "Hi", "attention": {"window": 1024, "sinks": 4}}"# => 400, "attention.window";
    http_unknown_model: "/v1/completions", r#"{"model": "gpt-9", "prompt": "Hi"}"# => 404, "model";
    http_chat_without_messages: "/v1/chat/completions", r#"{"messages": []}"# => 400, "messages";
    http_chat_messages_not_a_list: "/v1/chat/completions", r#"{"messages": "Hi"}"# => 400, "body";
    http_chat_message_with_an_unknown_role: "/v1/chat/completions",
        r#"{"messages": [{"role": "wizard", "content": "Hi"}]}"# => 400, "messages.[0].role";
    http_chat_message_with_a_tool_role: "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "42"}]}"#
        => 400, "messages.[1].role";
    http_logprobs_requested: "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": "Hi"}], "logprobs": true}"# => 400, "logprobs";
    http_tools_requested: "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]}"# => 400, "tools";
}

/// A body that says it is something other than JSON: 415.
#[test]
fn http_wrong_content_type() {
    expect_http_error(
        "http_wrong_content_type",
        "/v1/completions",
        &[("Content-Type", "text/plain")],
        br#"{"prompt": "Hi", "max_tokens": 2}"#,
        415,
        "content-type",
    );
}

/// A JSON body that is not UTF-8 (a string with byte 0xff): 400 naming the body.
#[test]
fn http_invalid_utf8_in_a_text_field() {
    let mut body = br#"{"prompt": "H"#.to_vec();
    body.extend_from_slice(&[0xff, 0xfe]);
    body.extend_from_slice(br#"i", "max_tokens": 2}"#);
    expect_http_error(
        "http_invalid_utf8_in_a_text_field",
        "/v1/completions",
        &[JSON],
        &body,
        400,
        "body",
    );
}

/// A body above `--max-request-bytes`: 413, before any of it is parsed.
#[test]
fn http_oversized_body() {
    let body = format!(
        r#"{{"prompt": "{}", "max_tokens": 2}}"#,
        "a ".repeat(MAX_REQUEST_BYTES)
    );
    expect_http_error(
        "http_oversized_body",
        "/v1/completions",
        &[JSON],
        body.as_bytes(),
        413,
        "body",
    );
}

/// Unknown fields are ignored, as OpenAI-compatible servers do (clients send `user`,
/// `metadata`, vendor extensions...): the request completes.
#[test]
fn http_unknown_fields_are_ignored() {
    let url = format!("{}/v1/completions", http_url());
    let r = support::http_raw(
        "POST",
        &url,
        &[JSON],
        Some(br#"{"prompt": "Hi", "max_tokens": 2, "temperature": 0, "no_such_field": {"x": 1}}"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON");
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
}

/// A known path with the wrong method (405) and an unknown path (404), in OpenAI's shape.
#[test]
fn http_wrong_method_and_unknown_path() {
    for (method, path, status) in [
        ("GET", "/v1/completions", 405),
        ("DELETE", "/v1/chat/completions", 405),
        ("GET", "/v1/no-such-endpoint", 404),
    ] {
        let r = support::http_raw(method, &format!("{}{path}", http_url()), &[], None);
        assert_eq!(r.status, status, "{method} {path}: {}", r.body);
        let v: serde_json::Value = serde_json::from_str(&r.body)
            .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {}", r.body));
        assert_eq!(v["error"]["code"], status, "{v}");
    }
}

/// `X-Request-Id` is the request's id: echoed back, and refused (409) while a request with
/// the same id is in flight.
#[test]
fn http_request_id_reused_while_in_flight() {
    let http = http_url();
    let id = format!("http-dup-{}", rand::random::<u32>());
    // The first request holds the id: a long generation, streamed so it is in flight.
    let grpc = url();
    rt().block_on(async {
        let mut c = support::client(&grpc).await;
        let mut first = c
            .generate(pb::GenerateRequest {
                request_id: id.clone(),
                ignore_eos: true,
                ..greedy(text("Count slowly"), 200)
            })
            .await
            .expect("first request")
            .into_inner();
        first
            .message()
            .await
            .expect("first token")
            .expect("a message");
        let body = br#"{"prompt": "Hi", "max_tokens": 2}"#;
        let r = tokio::task::spawn_blocking({
            let (http, id) = (http.clone(), id.clone());
            move || {
                support::http_raw(
                    "POST",
                    &format!("{http}/v1/completions"),
                    &[JSON, ("X-Request-Id", &id)],
                    Some(body),
                )
            }
        })
        .await
        .expect("join");
        assert_eq!(r.status, 409, "{}", r.body);
        assert!(r.body.contains(&id), "{}", r.body);
        drop(first);
    });
    // A fresh id is echoed back.
    let fresh = format!("{id}-b");
    let r = support::http_raw(
        "POST",
        &format!("{http}/v1/completions"),
        &[JSON, ("X-Request-Id", &fresh)],
        Some(br#"{"prompt": "Hi", "max_tokens": 2}"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-request-id").as_deref(), Some(fresh.as_str()));
}
