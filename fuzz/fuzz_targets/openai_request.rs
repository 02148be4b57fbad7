//! The HTTP door's request reading (headers and JSON body of the OpenAI endpoints) on
//! arbitrary bytes. Invariants: `duet_router::http::fuzzing::openai_request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    duet_router::http::fuzzing::openai_request(data);
});
