//! `--draft`: speculative decoding for `run`, `chat` and `bench`, with a draft model
//! or prompt lookup, and what it did.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use ballast::store::Beside;
use ballast_runtime::generate::{
    DraftModel, DraftOptions, Drafter, Generator, PromptLookup, SpeculationStats,
};
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::{Backend, Model, Session, Tokenizer};
use clap::Args;

/// Flags of speculative decoding.
#[derive(Args, Debug, Clone)]
pub struct DraftArgs {
    /// Speculative decoding: something cheap drafts the next tokens and one pass of the
    /// model verifies them all, keeping exactly the tokens the model alone would give.
    /// `ngram`: prompt lookup (copies what followed the last few tokens earlier in the
    /// context; pays when the output repeats the input, as an edit does). Otherwise a
    /// draft model: a GGUF file or a known model's name (`fetch-model --list`), smaller
    /// than the model and with the same vocabulary; what it reads per token is held in RAM.
    #[arg(long, value_name = "MODEL|ngram")]
    pub draft: Option<String>,
    /// Most tokens drafted per verification pass.
    #[arg(long = "draft-max", default_value_t = 16, value_name = "N")]
    pub draft_max: usize,
    /// Fewest drafted tokens worth a verification pass (a shorter draft is dropped and
    /// the token decoded plainly).
    #[arg(long = "draft-min", default_value_t = 0, value_name = "N")]
    pub draft_min: usize,
    /// A draft model stops drafting when its likeliest next token has a lower
    /// probability than this.
    #[arg(long = "draft-p-min", default_value_t = 0.75, value_name = "P", value_parser = unit_interval)]
    pub draft_p_min: f32,
    /// A draft model computes the logits of the first N tokens of its vocabulary only
    /// (the frequent ones: a vocabulary numbers its tokens roughly by frequency), and
    /// never drafts the rest; 0: all of them. The output head is most of a small
    /// model's reading per token, so this makes drafting cheaper; the output does not
    /// change, since the model verifies every drafted token.
    #[arg(long = "draft-vocab", default_value_t = DEFAULT_DRAFT_VOCAB, value_name = "N")]
    pub draft_vocab: usize,
}

/// `--draft-vocab`'s default.
pub const DEFAULT_DRAFT_VOCAB: usize = 32_768;

fn unit_interval(s: &str) -> std::result::Result<f32, String> {
    match s.parse::<f32>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("expected a probability in [0, 1], got {s:?}")),
    }
}

impl DraftArgs {
    /// The draft options.
    pub fn options(&self) -> DraftOptions {
        DraftOptions {
            max: self.draft_max,
            min: self.draft_min,
            p_min: self.draft_p_min,
        }
    }

    /// The drafter `--draft` names, if any: a draft model is loaded on `backend` with
    /// a cache for the `ctx` tokens of the model's context and a draft beyond it, and
    /// refused when its vocabulary is not the model's (`target`).
    pub fn drafter(
        &self,
        target: &Tokenizer,
        backend: Arc<dyn Backend>,
        ctx: usize,
        batch: usize,
    ) -> Result<Option<Box<dyn Drafter>>> {
        Ok(self.drafters(target, backend, ctx, batch, 1)?.pop())
    }

    /// [`DraftArgs::drafter`] for `n` sequences: `n` drafters, the draft model's
    /// weights loaded once and shared by their sessions. Empty without `--draft`.
    pub fn drafters(
        &self,
        target: &Tokenizer,
        backend: Arc<dyn Backend>,
        ctx: usize,
        batch: usize,
        n: usize,
    ) -> Result<Vec<Box<dyn Drafter>>> {
        let Some(draft) = self.draft.as_deref() else {
            return Ok(Vec::new());
        };
        anyhow::ensure!(self.draft_max > 0, "--draft-max must be at least 1");
        anyhow::ensure!(
            self.draft_min <= self.draft_max,
            "--draft-min {} is more than --draft-max {}",
            self.draft_min,
            self.draft_max
        );
        if draft == "ngram" {
            return Ok((0..n)
                .map(|_| Box::new(PromptLookup::default()) as Box<dyn Drafter>)
                .collect());
        }
        let path = crate::common::resolve_model(Some(Path::new(draft)))?;
        let load = || -> Result<Vec<Box<dyn Drafter>>> {
            let file = Arc::new(GgufFile::open(&path, true)?);
            let tokenizer = Tokenizer::from_gguf(&file)?;
            let vocab = match self.draft_vocab {
                0 => usize::MAX,
                n => n,
            };
            let model = Model::load_draft(file, backend, vocab)?;
            let name = path
                .file_name()
                .map_or_else(|| draft.to_string(), |n| n.to_string_lossy().into_owned());
            (0..n)
                .map(|_| {
                    let session =
                        Session::with_batch(model.share(), ctx + self.draft_max + 1, batch)?;
                    let drafter =
                        DraftModel::new(&name, session, &tokenizer, target, self.draft_p_min)?;
                    Ok(Box::new(drafter) as Box<dyn Drafter>)
                })
                .collect()
        };
        load().with_context(|| format!("loading the draft model {}", path.display()))
    }

    /// RAM a draft model will hold beside the model, and its name, for the budget: the
    /// weights a drafted token reads (copied into RAM: every matrix but the embedding
    /// table, the head cut to `--draft-vocab` rows), its f16 KV cache for `ctx` tokens
    /// and a draft, and its logits and activations. `None` without a draft model.
    pub fn resident_bytes(&self, ctx: usize) -> Result<Option<Beside>> {
        self.resident_bytes_for(ctx, 1)
    }

    /// [`DraftArgs::resident_bytes`] with `n` sequences (a cache each).
    pub fn resident_bytes_for(&self, ctx: usize, n: usize) -> Result<Option<Beside>> {
        let Some(draft) = self.draft.as_deref().filter(|d| *d != "ngram") else {
            return Ok(None);
        };
        let path = crate::common::resolve_model(Some(Path::new(draft)))?;
        let file = GgufFile::open(&path, true)
            .with_context(|| format!("opening the draft model {}", path.display()))?;
        let config = ballast_runtime::ModelConfig::from_gguf(&file)
            .with_context(|| format!("loading the draft model {}", path.display()))?;
        let weights = self.read_per_token()?.unwrap_or(0);
        let tokens = (ctx + self.draft_max + 1) as u64;
        let kv =
            2 * 2 * (config.n_layers * config.n_kv_heads * config.head_dim * n) as u64 * tokens;
        // Logits, and a pass's activations (a few rows of the widest matrices).
        let scratch = 4 * (config.vocab_size + 8 * (config.d_model + config.n_ff)) as u64;
        let name = format!(
            "the draft model {}",
            path.file_name()
                .map_or_else(|| draft.into(), |n| n.to_string_lossy())
        );
        Ok(Some(Beside {
            bytes: weights + kv + scratch,
            what: name,
        }))
    }

    /// Bytes of weights a draft model reads per drafted token: every matrix but the
    /// embedding table (a token reads one row of it), the output head cut to
    /// `--draft-vocab` rows. `None` without a draft model.
    pub fn read_per_token(&self) -> Result<Option<u64>> {
        let Some(draft) = self.draft.as_deref().filter(|d| *d != "ngram") else {
            return Ok(None);
        };
        let path = crate::common::resolve_model(Some(Path::new(draft)))?;
        let file = GgufFile::open(&path, true)
            .with_context(|| format!("opening the draft model {}", path.display()))?;
        let tensors = file.tensors();
        let head_rows = |t: &ballast_runtime::gguf::TensorInfo| {
            let rows = t.dims.get(1).copied().unwrap_or(1).max(1);
            let kept = match self.draft_vocab {
                0 => rows,
                n => rows.min(n as u64),
            };
            t.n_bytes / rows * kept
        };
        let has_head = tensors.iter().any(|t| t.name == "output.weight");
        Ok(Some(
            tensors
                .iter()
                .map(|t| match t.name.as_str() {
                    "output.weight" => head_rows(t),
                    // A tied head is the embedding table.
                    "token_embd.weight" if !has_head => head_rows(t),
                    "token_embd.weight" => 0,
                    _ => t.n_bytes,
                })
                .sum(),
        ))
    }

    /// `generator` decoding speculatively when `--draft` asks for it.
    pub fn apply(
        &self,
        generator: Generator,
        backend: Arc<dyn Backend>,
        ctx: usize,
        batch: usize,
    ) -> Result<Generator> {
        let tokenizer = generator.tokenizer().clone();
        Ok(match self.drafter(&tokenizer, backend, ctx, batch)? {
            Some(drafter) => generator.with_drafter(drafter, self.options()),
            None => generator,
        })
    }
}

/// One line on what speculation did: acceptance, tokens per pass of the model, time
/// drafting and verifying.
pub fn describe(stats: &SpeculationStats) -> String {
    format!(
        "speculation: {} verification passes, {} drafted, {} accepted ({:.0}%), {:.2} tokens per pass of the model ({} plain steps), drafting {:.0} ms, verifying {:.0} ms",
        stats.passes,
        stats.drafted,
        stats.accepted,
        stats.acceptance() * 100.0,
        stats.tokens_per_pass(),
        stats.plain_steps,
        stats.draft_time.as_secs_f64() * 1e3,
        stats.verify_time.as_secs_f64() * 1e3,
    )
}

/// The same as JSON.
pub fn to_json(stats: &SpeculationStats) -> serde_json::Value {
    serde_json::json!({
        "passes": stats.passes,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance": stats.acceptance(),
        "tokens_per_pass": stats.tokens_per_pass(),
        "plain_steps": stats.plain_steps,
        "draft_ms": stats.draft_time.as_secs_f64() * 1e3,
        "verify_ms": stats.verify_time.as_secs_f64() * 1e3,
    })
}
