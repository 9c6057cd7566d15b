//! Request parsing (proptest): any body gives a request or a 400, never a panic;
//! unknown fields never change the outcome; ranges are enforced exactly.

use ballast_server::api::{parse_request, Endpoint, Input};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

const SERVED: &str = "m";

/// Any JSON value, nested a few levels.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    // Known field names, so wrong types of real fields are tried too.
                    Just("messages".to_string()),
                    Just("prompt".to_string()),
                    Just("content".to_string()),
                    Just("role".to_string()),
                    Just("stop".to_string()),
                    Just("max_tokens".to_string()),
                    Just("temperature".to_string()),
                    Just("logprobs".to_string()),
                    Just("n".to_string()),
                    "[a-z_]{1,10}",
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn endpoint() -> impl Strategy<Value = Endpoint> {
    prop_oneof![Just(Endpoint::Chat), Just(Endpoint::Completion)]
}

fn valid(endpoint: Endpoint) -> Value {
    match endpoint {
        Endpoint::Chat => json!({"messages": [{"role": "user", "content": "hi"}]}),
        Endpoint::Completion => json!({"prompt": "hi"}),
    }
}

const KNOWN: [&str; 24] = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repeat_penalty",
    "repeat_last_n",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "top_logprobs",
    "role",
    "content",
    "type",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_bytes_give_a_request_or_a_400(body in prop::collection::vec(any::<u8>(), 0..256), ep in endpoint()) {
        if let Err(e) = parse_request(&body, ep, SERVED) {
            prop_assert_eq!(e.status, 400);
            prop_assert!(!e.message.is_empty());
        }
    }

    #[test]
    fn any_json_gives_a_request_or_a_400(v in any_json(), ep in endpoint()) {
        let body = serde_json::to_vec(&v).unwrap();
        match parse_request(&body, ep, SERVED) {
            Err(e) => {
                prop_assert_eq!(e.status, 400);
                // The error body is OpenAI's shape.
                let b = e.body();
                prop_assert!(b["error"]["message"].is_string() && b["error"]["type"].is_string());
            }
            // Only an object can be a request.
            Ok(_) => prop_assert!(v.is_object()),
        }
    }

    #[test]
    fn unknown_fields_are_ignored(extra in prop::collection::btree_map("[a-z_]{1,12}", any_json(), 0..8), ep in endpoint()) {
        let mut v = valid(ep);
        let base = parse_request(&serde_json::to_vec(&v).unwrap(), ep, SERVED).unwrap();
        for (k, x) in extra {
            if !KNOWN.contains(&k.as_str()) {
                v[k] = x;
            }
        }
        let got = parse_request(&serde_json::to_vec(&v).unwrap(), ep, SERVED).unwrap();
        prop_assert_eq!(got, base);
    }

    #[test]
    fn top_p_and_temperature_ranges_are_exact(top_p in -3.0f32..3.0, temp in -3.0f32..3.0, ep in endpoint()) {
        let mut v = valid(ep);
        v["top_p"] = json!(top_p);
        v["temperature"] = json!(temp);
        let r = parse_request(&serde_json::to_vec(&v).unwrap(), ep, SERVED);
        let ok = (0.0..=1.0).contains(&top_p) && temp >= 0.0;
        prop_assert_eq!(r.is_ok(), ok, "top_p {} temperature {}: {:?}", top_p, temp, r);
        if let Ok(g) = r {
            prop_assert_eq!(g.sampler.top_p, top_p);
            prop_assert_eq!(g.sampler.temperature, temp);
        }
    }

    #[test]
    fn a_conversation_keeps_its_messages_in_order(msgs in prop::collection::vec(("[a-z]{1,9}", ".{0,20}"), 1..6)) {
        let v = json!({"messages": msgs.iter().map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>()});
        let g = parse_request(&serde_json::to_vec(&v).unwrap(), Endpoint::Chat, SERVED).unwrap();
        let expected: Vec<(String, String)> = msgs.clone();
        prop_assert_eq!(g.input, Input::Chat(expected));
    }
}
