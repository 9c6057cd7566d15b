//! Chat template tests.

mod common;

use ballast_runtime::chat::{ChatMessage, ChatTemplate};
use ballast_runtime::error::Error;

#[test]
fn smollm2_template_default_system_prompt() {
    let Some((_, v)) = common::smollm_spec() else {
        return;
    };
    let src = v["tokenizer.chat_template"].as_str().expect("template");
    let tpl = ChatTemplate::new(src).unwrap();
    let out = tpl
        .render(
            &[ChatMessage::new("user", "What is 2+2?")],
            true,
            "<|im_start|>",
            "<|im_end|>",
        )
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    // An explicit system message replaces the default one; no generation prompt.
    let out = tpl
        .render(
            &[
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "Hi"),
            ],
            false,
            "",
            "",
        )
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn pycompat_methods_and_trim_blocks() {
    let tpl = ChatTemplate::new(
        "{{ bos_token }}{% for m in messages %}\n  {% if m.content.startswith('x') %}{{ m.content.strip().upper() }}{% endif %}\n{% endfor %}{{ eos_token }}",
    )
    .unwrap();
    let out = tpl
        .render(
            &[
                ChatMessage::new("user", "xy  "),
                ChatMessage::new("user", "no"),
            ],
            false,
            "<s>",
            "</s>",
        )
        .unwrap();
    assert_eq!(out, "<s>XY</s>");
}

#[test]
fn raise_exception_is_a_typed_error() {
    let tpl = ChatTemplate::new("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok").unwrap();
    assert_eq!(
        tpl.render(&[ChatMessage::new("user", "a")], false, "", "")
            .unwrap(),
        "ok"
    );
    match tpl.render(&[ChatMessage::new("assistant", "a")], false, "", "") {
        Err(Error::ChatTemplate { message, .. }) => {
            assert!(message.contains("first must be user"), "{message}")
        }
        other => panic!("unexpected: {other:?}"),
    }
}

#[test]
fn syntax_error_is_a_typed_error() {
    match ChatTemplate::new("{% for m in messages %}") {
        Err(Error::ChatTemplate { kind, .. }) => assert!(!kind.is_empty()),
        other => panic!("unexpected: {other:?}"),
    }
}

#[test]
fn common_template_constructs() {
    // Qwen2.5 / Llama-3 style constructs: whitespace control, namespace, tojson, loop vars.
    let src = r#"{%- set ns = namespace(sys=false) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'system' -%}{%- set ns.sys = true -%}{%- endif -%}
{%- endfor -%}
{{- bos_token -}}
{%- if not ns.sys %}<|im_start|>system
Default<|im_end|>
{% endif -%}
{%- for m in messages %}
<|im_start|>{{ m.role }}
{{ m.content | trim }}{% if loop.last %}!{% endif %}<|im_end|>
{% endfor -%}
{{ {"k": "v"} | tojson }}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"#;
    let tpl = ChatTemplate::new(src).unwrap();
    let out = tpl
        .render(&[ChatMessage::new("user", " hi ")], true, "<s>", "")
        .unwrap();
    assert_eq!(
        out,
        "<s><|im_start|>system\nDefault<|im_end|>\n<|im_start|>user\nhi!<|im_end|>\n{\"k\": \"v\"}<|im_start|>assistant\n"
    );
}

#[test]
fn strftime_now_is_available() {
    let tpl = ChatTemplate::new("{{ strftime_now('%Y-%m-%d %j %b') }}").unwrap();
    let out = tpl.render(&[], false, "", "").unwrap();
    let parts: Vec<&str> = out.split(' ').collect();
    assert_eq!(parts.len(), 3, "{out}");
    let ymd: Vec<&str> = parts[0].split('-').collect();
    assert_eq!(ymd.len(), 3);
    let year: i32 = ymd[0].parse().unwrap();
    assert!(year >= 2024);
    let month: usize = ymd[1].parse().unwrap();
    let names = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    assert_eq!(parts[2], names[month - 1]);
    let yday: u32 = parts[1].parse().unwrap();
    assert!((1..=366).contains(&yday));
}

#[test]
fn tojson_matches_python_json_dumps() {
    let tpl = ChatTemplate::new(
        r#"{{ {"name": "f", "b": [1, 2.5, true, none], "s": "é\"\n"} | tojson }}|{{ {"a": {"b": []}, "c": [1]} | tojson(indent=2) }}"#,
    )
    .unwrap();
    let out = tpl.render(&[], false, "", "").unwrap();
    assert_eq!(
        out,
        "{\"name\": \"f\", \"b\": [1, 2.5, true, null], \"s\": \"é\\\"\\n\"}|{\n  \"a\": {\n    \"b\": []\n  },\n  \"c\": [\n    1\n  ]\n}"
    );
}

#[test]
fn messages_keep_python_dict_order() {
    let tpl = ChatTemplate::new("{{ messages | tojson }}").unwrap();
    let out = tpl
        .render(&[ChatMessage::new("user", "hi")], false, "", "")
        .unwrap();
    assert_eq!(out, r#"[{"role": "user", "content": "hi"}]"#);
}
