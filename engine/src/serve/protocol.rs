//! The engine worker protocol: newline-delimited JSON over the worker's stdin (commands) and stdout (messages),
//! one object per line (DESIGN.md section 3). The worker's stderr carries the human log only.
//!
//! A request's life: the front writes `{"op":"generate","id":7,...}`; the worker answers zero or more
//! `{"type":"text","id":7,"text":"..."}` lines, then exactly one `done` or `failed` line for id 7. The front may
//! write `{"op":"cancel","id":7}` at any time; the worker then ends id 7 within one token, still with `done`
//! (stop `cancelled`). `event` lines ([`crate::events`]: load, request, fallback, fault) may come at any time.

use serde::{Deserialize, Serialize};

use crate::runtime::grammar::GrammarSpec;
use crate::runtime::sampling::{SamplingParams, TokenLogprob};

pub use crate::events::{Event, SCHEMA_VERSION as EVENT_SCHEMA_VERSION};

/// A command from the front to the worker (one stdin line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    Generate(GenerateJob),
    /// End request `id` as soon as possible (its client went away).
    Cancel {
        id: u64,
    },
    /// Report the slots (`GET /slots`): the worker answers [`Message::Slots`] with the same `id`.
    Slots {
        id: u64,
    },
}

/// One generation: prompt ids (already rendered and tokenized by the front), limits and sampling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateJob {
    pub id: u64,
    /// Prompt token ids; never empty, never longer than the context (the front checks both).
    pub prompt: Vec<u32>,
    /// Most tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// Stop strings: generation ends when one appears; it is not sent.
    #[serde(default)]
    pub stop: Vec<String>,
    /// The whole sampler chain, as `strata generate` runs it (the front fills in the server's defaults for what
    /// the request did not name).
    pub sampling: SamplingParams,
    /// Report each generated token's log-probability and this many alternatives (0 to
    /// [`crate::runtime::sampling::MAX_TOP_LOGPROBS`]) in its `text` messages; `None`: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<usize>,
    /// A grammar the answer must follow (structured output, a required tool call); `None`: free text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grammar: Option<GrammarSpec>,
}

/// A message from the worker to the front (one stdout line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    /// The model is loaded; requests may be sent.
    Ready {
        /// Context cells, in tokens.
        n_ctx: usize,
        pid: u32,
    },
    /// A piece of generated text (whole UTF-8 characters, stop strings held back) and, when the job asked for
    /// them, the log-probabilities of the tokens it completes (a last piece may carry only those).
    Text {
        id: u64,
        text: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        logprobs: Vec<TokenLogprob>,
    },
    /// Prefill progress of request `id`: `read` of `total` prompt tokens computed, sent after each
    /// prefill chunk but the last. Any message also tells the front's watchdog the worker is alive, so a long
    /// prefill is not taken for a hang.
    Progress { id: u64, read: usize, total: usize },
    /// The worker is computing request `id`: sent every [`HEARTBEAT`] while it starts work
    /// ([`crate::backend::progress`]), so the front's watchdog tells a long prefill chunk from a hang (a hung
    /// engine starts nothing and sends none).
    Busy { id: u64 },
    /// Request `id` ended normally; `stop_word` is the stop string that ended it, when one did.
    Done {
        id: u64,
        stop: Finish,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stop_word: Option<String>,
        timings: Timings,
    },
    /// Request `id` could not run (an error about the request itself, e.g. an id outside the vocabulary).
    Failed { id: u64, message: String },
    /// The answer to [`Command::Slots`] `id`: every slot's state, between two steps.
    Slots {
        id: u64,
        slots: Vec<crate::runtime::batch::SlotState>,
    },
    /// The slots' KV pool after a step that changed it (`/metrics`' `strata_kv_blocks_*`).
    Kv(crate::runtime::batch::KvUsage),
    /// A structured event (see [`Event`]).
    Event(Event),
}

/// How often a computing worker says [`Message::Busy`].
pub const HEARTBEAT: std::time::Duration = std::time::Duration::from_millis(250);

/// Why a generation ended (the wire form of [`crate::runtime::generate::StopReason`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// An end-of-generation token.
    Eog,
    /// A stop string.
    StopString,
    /// The `max_tokens` limit.
    Limit,
    /// The context filled up.
    Context,
    /// The front cancelled it.
    Cancelled,
}

impl Finish {
    /// Whether the answer was cut before it ended: by `max_tokens` or by the context.
    pub fn is_cut(self) -> bool {
        matches!(self, Finish::Limit | Finish::Context)
    }
}

impl From<crate::runtime::generate::StopReason> for Finish {
    fn from(r: crate::runtime::generate::StopReason) -> Finish {
        use crate::runtime::generate::StopReason as S;
        match r {
            S::Eog => Finish::Eog,
            S::StopString => Finish::StopString,
            S::Limit => Finish::Limit,
            S::Context => Finish::Context,
            S::Cancelled => Finish::Cancelled,
        }
    }
}

/// Counts and times of one request, in llama.cpp server's `timings` names; every API response carries it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// Prompt tokens computed (not reused from the cache).
    pub prompt_n: usize,
    /// Prompt tokens reused from the cache (prefix reuse).
    pub cache_n: usize,
    /// Prefill time, ms.
    pub prompt_ms: f64,
    /// Tokens generated (a final end-of-generation token included).
    pub predicted_n: usize,
    /// Decode time, ms.
    pub predicted_ms: f64,
}

impl Timings {
    /// All prompt tokens: computed plus reused.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_n + self.cache_n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        let cmd = Command::Generate(GenerateJob {
            id: 7,
            prompt: vec![1, 2],
            max_tokens: 3,
            stop: vec!["\n".into()],
            sampling: SamplingParams {
                top_k: 5,
                seed: Some(1),
                ..SamplingParams::greedy()
            },
            logprobs: Some(2),
            grammar: Some(GrammarSpec::Lark {
                grammar: "start: \"a\"".into(),
            }),
        });
        let line = serde_json::to_string(&cmd).unwrap();
        assert!(line.starts_with(r#"{"op":"generate","id":7"#), "{line}");
        assert_eq!(serde_json::from_str::<Command>(&line).unwrap(), cmd);
        // Sampling fields left out take the sampler's defaults.
        let short: Command =
            serde_json::from_str(r#"{"op":"generate","id":1,"prompt":[1],"max_tokens":1,"sampling":{"top_k":3}}"#)
                .unwrap();
        let Command::Generate(job) = short else { panic!() };
        assert_eq!(
            job.sampling,
            SamplingParams {
                top_k: 3,
                ..SamplingParams::default()
            }
        );
        let ev = Message::Event(Event::now(crate::events::EventKind::Fault(crate::events::Fault {
            error: "boom".into(),
            ..Default::default()
        })));
        let line = serde_json::to_string(&ev).unwrap();
        assert!(
            line.contains(r#""type":"event""#) && line.contains(r#""event":"fault""#),
            "{line}"
        );
        assert_eq!(serde_json::from_str::<Message>(&line).unwrap(), ev);
    }
}
