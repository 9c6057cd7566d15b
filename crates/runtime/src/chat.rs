//! Chat templates: the GGUF's `tokenizer.chat_template` (Jinja) rendered with
//! `minijinja`, configured like Hugging Face's `apply_chat_template` and llama.cpp
//! (`trim_blocks`, `lstrip_blocks`, Python string methods, `raise_exception`).
//!
//! # Example
//! ```
//! use ballast_runtime::chat::{ChatMessage, ChatTemplate};
//!
//! let tpl = ChatTemplate::new(
//!     "{% for m in messages %}<|{{ m.role }}|>{{ m.content.strip() }}\n{% endfor %}\
//!      {% if add_generation_prompt %}<|assistant|>{% endif %}",
//! )?;
//! let out = tpl.render(&[ChatMessage::new("user", "  hi  ")], true, "<s>", "</s>")?;
//! assert_eq!(out, "<|user|>hi\n<|assistant|>");
//! # Ok::<(), ballast_runtime::error::Error>(())
//! ```

use std::collections::BTreeMap;

use minijinja::{Environment, ErrorKind, Value};

use crate::error::{Error, Result};

const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// Role: `"system"`, `"user"`, `"assistant"`, ...
    pub role: String,
    /// Message text.
    pub content: String,
}

impl ChatMessage {
    /// Convenience constructor.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
}

fn convert_error(err: minijinja::Error) -> Error {
    let mut message = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    Error::ChatTemplate {
        kind: err.kind().to_string(),
        line: err.line(),
        message,
    }
}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("template raised an exception: {message}"),
    ))
}

/// Converts days since 1970-01-01 to a civil (year, month 1-12, day 1-31) date.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Writes `s` as a JSON string the way Python's `json.dumps(..., ensure_ascii=False)` does.
fn write_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Serializes a template value like Python's `json.dumps` (separators `", "`/`": "`, or
/// `","` + newlines when `indent` is given), which is what HF and llama.cpp templates expect.
fn write_json(
    out: &mut String,
    value: &Value,
    indent: Option<usize>,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&value.to_string()),
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default()),
        ValueKind::Map => {
            let keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                match key.as_str() {
                    Some(k) => write_json_string(out, k),
                    None => write_json_string(out, &key.to_string()),
                }
                out.push_str(": ");
                write_json(out, &value.get_item(key)?, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => write_json_string(out, &value.to_string()),
    }
    Ok(())
}

/// The `tojson` filter with Python `json.dumps` formatting; accepts `indent=N`.
fn tojson(
    value: Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, &value, indent, 0)?;
    Ok(Value::from_safe_string(out))
}

/// Days since 1970-01-01 of a civil date (inverse of [`civil_from_days`]).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `strftime_now(format)`: the current UTC time formatted with the common `strftime`
/// directives (`%Y %m %d %e %H %M %S %b %B %a %A %y %j %p %I %%`), as used by e.g. Llama 3.x templates.
fn strftime_now(format: String) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (tod / 3600, tod / 60 % 60, tod % 60);
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let month = MONTHS[(m - 1) as usize];
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &y.to_string(),
            Some('y') => out += &format!("{:02}", y.rem_euclid(100)),
            Some('m') => out += &format!("{m:02}"),
            Some('d') => out += &format!("{d:02}"),
            Some('e') => out += &format!("{d:2}"),
            Some('H') => out += &format!("{hh:02}"),
            Some('I') => out += &format!("{:02}", if hh % 12 == 0 { 12 } else { hh % 12 }),
            Some('p') => out += if hh < 12 { "AM" } else { "PM" },
            Some('M') => out += &format!("{mm:02}"),
            Some('S') => out += &format!("{ss:02}"),
            Some('j') => out += &format!("{yday:03}"),
            Some('b') => out += &month[..3],
            Some('B') => out += month,
            Some('a') => out += &weekday[..3],
            Some('A') => out += weekday,
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

impl ChatTemplate {
    /// Compiles a template source (usually the GGUF's `tokenizer.chat_template`).
    /// Syntax errors give [`Error::ChatTemplate`].
    pub fn new(source: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(convert_error)?;
        Ok(ChatTemplate { env })
    }

    /// Renders a conversation. `bos_token`/`eos_token` are exposed to the template under
    /// those names (use the vocabulary's texts, e.g. `"<|im_start|>"`).
    /// Render failures, including `raise_exception(...)`, give [`Error::ChatTemplate`].
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                // Insertion order kept (role, content), as in a Python dict.
                Value::from_iter([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ])
            })
            .collect();
        let mut ctx = BTreeMap::new();
        ctx.insert("messages", Value::from(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        ctx.insert("bos_token", Value::from(bos_token));
        ctx.insert("eos_token", Value::from(eos_token));
        let tpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(convert_error)?;
        tpl.render(Value::from(ctx)).map_err(convert_error)
    }
}
