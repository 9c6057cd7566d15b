//! `ballast chat`: a conversation using the model's own chat template.

use std::io::{BufRead, Write};

use anyhow::{Context, Result};
use ballast_runtime::chat::{ChatMessage, ChatTemplate};
use ballast_runtime::{GenerateOptions, Step};
use clap::Args;

use crate::common::{self, ModelArgs, SamplingArgs};

/// Flags of `ballast chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// A system prompt (the template's own default when not given).
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per answer.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    pub n_predict: usize,
    /// Context size in tokens (the whole conversation).
    #[arg(short = 'c', long = "ctx", default_value_t = 4096)]
    pub ctx: usize,
    /// Keep generating past end-of-generation tokens (each answer then runs to -n).
    #[arg(long)]
    pub ignore_eos: bool,
    #[command(flatten)]
    pub draft: crate::draft::DraftArgs,
}

pub fn run(mut args: ChatArgs) -> Result<()> {
    // A resident draft model shares the RAM budget with the model.
    args.model.store.beside = args.draft.resident_bytes(args.ctx)?;
    let engine = common::load(args.model.builder(args.ctx, None)?)?;
    let file = engine.file().clone();
    let source = file
        .get_str("tokenizer.chat_template")
        .context("this model has no chat template; use `ballast run`")?;
    let template = ChatTemplate::new(source)?;
    let tokenizer = engine.tokenizer().clone();
    let bos = tokenizer
        .bos_id()
        .map(|id| tokenizer.decode(&[id]))
        .unwrap_or_default();
    let eos = tokenizer
        .eos_id()
        .map(|id| tokenizer.decode(&[id]))
        .unwrap_or_default();
    let options = GenerateOptions {
        sampler: args.sampling.config(),
        max_tokens: Some(args.n_predict),
        ignore_eos: args.ignore_eos,
        ..GenerateOptions::default()
    };
    let backend = engine.model().backend().clone();
    let generator = engine.generator(options)?;
    let mut generator = args.draft.apply(generator, backend, args.ctx, 64)?;
    let mut messages: Vec<ChatMessage> = Vec::new();
    if let Some(system) = &args.system {
        messages.push(ChatMessage {
            role: "system".into(),
            content: system.clone(),
        });
    }
    // The text the cache holds so far. Each turn renders the whole conversation; when
    // it extends what was fed, only the new part is fed, else the cache starts over.
    let mut fed = String::new();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    eprintln!("chat with the model; an empty line or end of input quits.");
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        messages.push(ChatMessage {
            role: "user".into(),
            content: line.trim_end().to_string(),
        });
        let text = template.render(&messages, true, &bos, &eos)?;
        let new_text = match text.strip_prefix(fed.as_str()) {
            Some(rest) if !fed.is_empty() => rest.to_string(),
            _ => {
                generator.session_mut().rewind(0);
                text.clone()
            }
        };
        let held = generator.session().tokens().len();
        let ids = tokenizer.encode(&new_text, held == 0, true)?;
        anyhow::ensure!(
            held + ids.len() < args.ctx,
            "the conversation no longer fits the context of {} tokens (raise -c)",
            args.ctx
        );
        generator.prompt(&ids)?;
        let mut answer = String::new();
        loop {
            match generator.step()? {
                Step::Token(token) => {
                    answer.push_str(&token.text);
                    write!(out, "{}", token.text)?;
                    out.flush()?;
                }
                Step::Done(end) => {
                    answer.push_str(&end.text);
                    writeln!(out, "{}", end.text)?;
                    break;
                }
            }
        }
        // The answer's last token when the limit ended it: the cache then holds the
        // whole answer, and the next turn feeds only what follows it.
        generator.feed_last_token()?;
        fed = tokenizer.decode_with(generator.session().tokens(), true);
        messages.push(ChatMessage {
            role: "assistant".into(),
            content: answer,
        });
    }
    Ok(())
}
