//! Fuzzes request parsing, the server's network format: any body, for either endpoint,
//! must give a request or a 400 with an OpenAI error object, never a panic.
#![no_main]

use ballast_server::api::{parse_request, Endpoint};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for endpoint in [Endpoint::Chat, Endpoint::Completion] {
        match parse_request(data, endpoint, "m") {
            Ok(generation) => {
                let _ = format!("{generation:?}");
            }
            Err(e) => {
                assert_eq!(e.status, 400, "{}", e.message);
                let body = e.body();
                assert!(body["error"]["message"].is_string(), "{body}");
                assert!(body["error"]["type"].is_string(), "{body}");
            }
        }
    }
});
