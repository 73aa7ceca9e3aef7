//! Constrained decoding: a JSON schema or a Lark grammar enforced token by token, so the output always parses
//! (structured output, `tool_choice: required`; issue 18, points 1 and 2).
//!
//! | entry | what | errors |
//! |---|---|---|
//! | [`GrammarEnv::new`] | a model's vocabulary indexed for the constraint engine, once per model | none |
//! | [`GrammarEnv::check`] | whether a [`GrammarSpec`] can be enforced | [`GrammarError`] naming the part |
//! | [`RecentGrammars`] | matchers for the specs a worker sees, each compiled once while among the last few | as `check` |
//! | [`Constrained`] | a [`TokenSampler`] that masks every token the grammar forbids before its inner sampler draws | — |
//!
//! The engine is llguidance (Microsoft's "super-fast structured outputs", the one llama.cpp, vLLM and SGLang
//! link): its JSON-schema compiler and Lark parser, and a token trie over the vocabulary. Control tokens are
//! indexed behind llguidance's special-token marker, so no grammar can write one as text; end-of-generation is
//! allowed exactly when the grammar accepts, and forced once it can go no further.
//!
//! Source: llguidance's `Matcher` interface (`compute_mask`, `consume_token`), its JSON-schema subset
//! (docs/json_schema.md in its repository) and Lark syntax with `%json` (docs/syntax.md).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, InferenceCapabilities, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};

use crate::runtime::generate::TokenSampler;
use crate::runtime::session::StepLogits;
use crate::tokenizer::{TokenKind, Tokenizer};

/// What to enforce, as the worker protocol carries it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum GrammarSpec {
    /// A JSON value valid against `schema` (JSON Schema; `{"type": "object"}` is OpenAI's `json_object`).
    JsonSchema { schema: serde_json::Value },
    /// Text matching a Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON schema).
    Lark { grammar: String },
}

/// Why a grammar cannot be enforced.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The constraint engine refused it; `message` is its own (it names the keyword or rule at fault).
    #[error("{message}")]
    Unsupported { message: String },
    /// The model has no end-of-generation token to end a constrained answer with.
    #[error("the model has no end-of-generation token, so a constrained answer could never end")]
    NoEnd,
}

/// A model's vocabulary indexed for the constraint engine; build it once per model (about a second for a
/// 150k-token vocabulary) and share it.
pub struct GrammarEnv {
    factory: ParserFactory,
    /// Every end-of-generation id: any of them ends a constrained answer the grammar accepts.
    eog: Vec<u32>,
    /// The one llguidance knows as EOS.
    eos: u32,
    /// Tokens in the vocabulary.
    vocab: usize,
}

impl GrammarEnv {
    /// Indexes `tokenizer`'s vocabulary: each token's bytes, control and unknown tokens behind the special-token
    /// marker.
    ///
    /// Errors: [`GrammarError::NoEnd`] without an end-of-generation token; [`GrammarError::Unsupported`] if the
    /// engine refuses the vocabulary.
    pub fn new(tokenizer: &Tokenizer) -> Result<GrammarEnv, GrammarError> {
        let eog: Vec<u32> = tokenizer.eog_ids().to_vec();
        let eos = tokenizer
            .eot()
            .or(tokenizer.eos())
            .or(eog.first().copied())
            .ok_or(GrammarError::NoEnd)?;
        let n = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| match tokenizer.token_kind(id) {
                Some(TokenKind::Control | TokenKind::Unknown) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.token_text(id).unwrap_or("").as_bytes());
                    w
                }
                _ => tokenizer.token_to_piece(id).map(<[u8]>::to_vec).unwrap_or_default(),
            })
            .collect();
        let info = TokRxInfo::new(n as u32, eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let caps = InferenceCapabilities {
            ff_tokens: false,
            backtrack: false,
            conditional_ff_tokens: false,
            fork: false,
        };
        let mut factory = ParserFactory::new(&env, caps, &llguidance::earley::SlicedBiasComputer::general_slices())
            .map_err(unsupported)?;
        factory.set_stderr_log_level(0);
        // An object of n optional properties takes about 4 n items in an Earley row (llguidance's default of 2,000
        // ends an answer of 501 at its `{`); errors in one line, without the parser's state.
        let limits = factory.limits_mut();
        limits.max_items_in_row = limits.max_items_in_row.max(5 * MAX_SCHEMA_PROPERTIES);
        limits.verbose_errors = false;
        Ok(GrammarEnv {
            factory,
            eog,
            eos,
            vocab: n,
        })
    }

    /// A matcher for `spec`, at the start of the answer.
    ///
    /// Errors: [`GrammarError::Unsupported`] with the engine's message (an unknown or unsupported JSON-schema
    /// keyword, a Lark syntax error), or for a JSON schema no value satisfies that way (no token can begin the
    /// answer: `{"anyOf": [{"$ref": "#"}]}`, a `$ref` that leads only back to itself), which would answer an
    /// empty text.
    pub fn matcher(&self, spec: &GrammarSpec) -> Result<Matcher, GrammarError> {
        let grammar = match spec {
            GrammarSpec::JsonSchema { schema } => {
                check_schema_size(schema)?;
                TopLevelGrammar::from_json_schema(schema.clone())
            }
            GrammarSpec::Lark { grammar } => TopLevelGrammar::from_lark(grammar.clone()),
        };
        let parser = self.factory.create_parser(grammar).map_err(unsupported)?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(message) = matcher.get_error() {
            return Err(GrammarError::Unsupported { message });
        }
        if matches!(spec, GrammarSpec::JsonSchema { .. }) {
            // The engine either masks every token or stops at once (its error's first line says how).
            let why = match matcher.compute_mask() {
                Ok(mask) if mask.num_set() > usize::from(mask.is_allowed(self.eos)) => None,
                Ok(_) => Some(String::new()),
                Err(e) => Some(format!(
                    "; the constraint engine: {}",
                    e.to_string().lines().next().unwrap_or("")
                )),
            };
            if let Some(why) = why {
                return Err(GrammarError::Unsupported {
                    message: format!(
                        "no JSON value satisfies the schema: nothing can begin the answer (a $ref that only leads \
                         back to itself?){why}"
                    ),
                });
            }
        }
        Ok(matcher)
    }

    /// Checks that `spec` can be enforced (what the front answers 400 for before queueing a request).
    ///
    /// Errors: as [`GrammarEnv::matcher`].
    pub fn check(&self, spec: &GrammarSpec) -> Result<(), GrammarError> {
        self.matcher(spec).map(|_| ())
    }
}

/// The compiled grammars of the [`RecentGrammars::KEPT`] specs used last, each kept at the answer's start: a spec
/// seen among them again, written the same way (the `n` choices of one request, or the same tool or response
/// schema request after request; [`spec_key`]: properties in another order are another spec, since the answer
/// writes them in the schema's order) gets a deep clone (llguidance's `Matcher::deep_clone`: the parser and its
/// lexer caches, for independent use) instead of a second compile: for a schema of 1,000 integer properties,
/// 90-190 ms compiled against 0.2 ms cloned on the 2-core machine (tests/cpu,
/// `recent_grammars_compile_a_spec_once_and_clone_it_from_the_start`).
pub struct RecentGrammars {
    kept: RecentSpecs<Matcher>,
    compiles: u64,
}

impl Default for RecentGrammars {
    fn default() -> Self {
        RecentGrammars {
            kept: RecentSpecs::new(Self::KEPT),
            compiles: 0,
        }
    }
}

impl RecentGrammars {
    /// Specs kept compiled.
    pub const KEPT: usize = 4;
    /// The largest spec kept ([`RecentSpecs::KEY_MAX`]).
    pub const KEY_MAX: usize = RecentSpecs::<Matcher>::KEY_MAX;

    /// A matcher for `spec` at the answer's start: a clone of the kept one when `spec` is among the
    /// [`RecentGrammars::KEPT`] used last, else compiled by `env` (and kept, the least recently used going). A spec
    /// that does not compile, or of more than [`RecentGrammars::KEY_MAX`] bytes, is not kept.
    ///
    /// Errors: as [`GrammarEnv::matcher`].
    pub fn matcher(&mut self, env: &GrammarEnv, spec: &GrammarSpec) -> Result<Matcher, GrammarError> {
        let key = spec_key(spec);
        if let Some(m) = self.kept.get(&key) {
            return Ok(m.deep_clone());
        }
        let m = env.matcher(spec)?;
        self.compiles += 1;
        self.kept.keep(key, m.deep_clone());
        Ok(m)
    }

    /// Specs compiled so far (the rest were clones).
    pub fn compiles(&self) -> u64 {
        self.compiles
    }
}

/// The `cap` specs used last, each with a value (a compiled grammar, or nothing where only "it compiles" is kept),
/// by [`spec_key`], most recently used first.
pub struct RecentSpecs<V> {
    kept: std::collections::VecDeque<(String, V)>,
    cap: usize,
}

impl<V> RecentSpecs<V> {
    /// The largest key kept, bytes: a body of megabytes of annotations (`default`, `description`) compiles, but
    /// is not held after its answer.
    pub const KEY_MAX: usize = 256 << 10;

    /// Keeps at most `cap` specs.
    pub fn new(cap: usize) -> Self {
        RecentSpecs {
            kept: std::collections::VecDeque::with_capacity(cap + 1),
            cap,
        }
    }

    /// The value kept for `key`, which becomes the most recently used.
    pub fn get(&mut self, key: &str) -> Option<&V> {
        let i = self.kept.iter().position(|(k, _)| k == key)?;
        let entry = self.kept.remove(i).expect("found");
        self.kept.push_front(entry);
        self.kept.front().map(|(_, v)| v)
    }

    /// Keeps `value` for `key` as the most recently used (replacing one kept for it), the least recently used
    /// going past `cap`; a key of more than [`RecentSpecs::KEY_MAX`] bytes is not kept.
    pub fn keep(&mut self, key: String, value: V) {
        if key.len() > Self::KEY_MAX {
            return;
        }
        self.kept.retain(|(k, _)| *k != key);
        self.kept.push_front((key, value));
        self.kept.truncate(self.cap);
    }
}

/// `spec` as the worker protocol writes it (JSON, object keys in the order the client wrote them): two specs with the
/// same key compile to the same grammar. (`GrammarSpec`'s `==` is not that: with serde_json's `preserve_order`
/// it ignores key order, while llguidance writes an object's properties in the schema's order.)
pub fn spec_key(spec: &GrammarSpec) -> String {
    serde_json::to_string(spec).expect("a GrammarSpec serializes")
}

/// The deepest a JSON schema may nest, counting each object, array and local `$ref` hop. llguidance's compiler
/// recurses once per level, so a long enough `$ref` chain in a small body would overflow a thread's stack and
/// abort the process; real schemas (Pydantic's, OpenAI's strict ones) stay far below this.
pub const MAX_SCHEMA_DEPTH: usize = 128;

/// The most property names a JSON schema may hold in all: each object's `properties` keys and the `required`
/// names it does not list there (llguidance adds those as properties too), summed over every object, a `$ref`
/// target counted where it is defined and once more where it is first used. llguidance's compiler recurses once
/// per property of an object, and merges an `allOf`'s objects into one (about 7,000 properties fit a 2 MiB thread
/// stack), and its compile time grows faster than the count (1,000 optional properties took 0.4 s, 5,000 took 9 s
/// on a 2-core machine), so the sum bounds the merged objects too. Real tool schemas hold a few dozen.
pub const MAX_SCHEMA_PROPERTIES: usize = 1000;

/// Checks that `schema` nests at most [`MAX_SCHEMA_DEPTH`] levels with its local `$ref`s followed (a recursive
/// reference counts once), holds at most [`MAX_SCHEMA_PROPERTIES`] property names, and has no `$ref` that leads
/// back to itself through `$ref`s alone (`{"$ref": "#"}`, or two definitions naming each other): such a schema
/// describes no value, and the constraint engine would only find that out mid-answer.
///
/// Errors: [`GrammarError::Unsupported`] naming the limit or the loop.
pub fn check_schema_size(schema: &serde_json::Value) -> Result<(), GrammarError> {
    use serde_json::Value as J;
    use std::collections::HashMap;
    /// Depth of `v`, at most `limit + 1`; `memo` holds finished `$ref` targets, `open` those being walked;
    /// `names` sums the property names of the objects walked.
    fn depth(
        v: &J,
        root: &J,
        level: usize,
        memo: &mut HashMap<String, usize>,
        open: &mut Vec<String>,
        names: &mut usize,
    ) -> usize {
        if level > MAX_SCHEMA_DEPTH {
            return 1;
        }
        let children = match v {
            J::Object(map) => {
                let props = map.get("properties").and_then(J::as_object);
                let listed = props.map_or(0, |p| p.len());
                let extra = map.get("required").and_then(J::as_array).map_or(0, |r| {
                    r.iter()
                        .filter(|n| n.as_str().is_none_or(|n| props.is_none_or(|p| !p.contains_key(n))))
                        .count()
                });
                *names = names.saturating_add(listed + extra);
                let mut d = 0;
                if let Some(J::String(r)) = map.get("$ref")
                    && let Some(ptr) = r.strip_prefix('#')
                {
                    let sub = if let Some(&m) = memo.get(ptr) {
                        m
                    } else if open.iter().any(|o| o == ptr) {
                        0
                    } else if let Some(target) = root.pointer(ptr) {
                        open.push(ptr.to_string());
                        let m = depth(target, root, level + 1, memo, open, names);
                        open.pop();
                        memo.insert(ptr.to_string(), m);
                        m
                    } else {
                        0
                    };
                    d = d.max(sub);
                }
                for x in map.values() {
                    d = d.max(depth(x, root, level + 1, memo, open, names));
                }
                d
            }
            J::Array(items) => items
                .iter()
                .map(|x| depth(x, root, level + 1, memo, open, names))
                .max()
                .unwrap_or(0),
            _ => 0,
        };
        1 + children
    }
    /// The first `$ref` of a node under `v` whose chain of `$ref`s (each target's own `$ref`, as long as it has
    /// one) comes back to a node of the chain; `ends` holds the nodes whose chains are known to end.
    fn ref_loop(v: &J, root: &J, ends: &mut std::collections::HashSet<*const J>) -> Option<String> {
        match v {
            J::Object(map) => {
                let mut chain: Vec<*const J> = vec![v];
                let mut at = v;
                while let Some(J::String(r)) = at.get("$ref") {
                    let Some(next) = r.strip_prefix('#').and_then(|p| root.pointer(p)) else {
                        break;
                    };
                    let p = next as *const J;
                    if ends.contains(&p) {
                        break;
                    }
                    if chain.contains(&p) {
                        return Some(r.clone());
                    }
                    if chain.len() > MAX_SCHEMA_DEPTH {
                        break;
                    }
                    chain.push(p);
                    at = next;
                }
                ends.extend(chain);
                // Values (a default, a constant, examples) are data, not schemas: a "$ref" there means nothing.
                map.iter()
                    .filter(|(k, _)| !matches!(k.as_str(), "default" | "const" | "enum" | "examples"))
                    .find_map(|(_, x)| ref_loop(x, root, ends))
            }
            J::Array(items) => items.iter().find_map(|x| ref_loop(x, root, ends)),
            _ => None,
        }
    }
    let mut names = 0;
    if depth(schema, schema, 0, &mut HashMap::new(), &mut Vec::new(), &mut names) > MAX_SCHEMA_DEPTH {
        return Err(GrammarError::Unsupported {
            message: format!(
                "the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (objects, arrays and $ref hops counted)"
            ),
        });
    }
    if let Some(r) = ref_loop(schema, schema, &mut Default::default()) {
        return Err(GrammarError::Unsupported {
            message: format!(
                "the schema's \"$ref\": \"{r}\" leads back to itself through $refs alone, so no value matches it"
            ),
        });
    }
    if names > MAX_SCHEMA_PROPERTIES {
        return Err(GrammarError::Unsupported {
            message: format!(
                "the schema holds {names} property names (properties and required, over all its objects); at most {MAX_SCHEMA_PROPERTIES} are supported"
            ),
        });
    }
    Ok(())
}

fn unsupported(e: impl std::fmt::Display) -> GrammarError {
    GrammarError::Unsupported { message: e.to_string() }
}

/// A [`TokenSampler`] under a grammar: each step, the tokens the grammar forbids get -inf logits, then `inner`
/// draws (with its own temperature, filters and penalties) from the rest. End-of-generation is allowed only where
/// the grammar accepts; once the grammar can go no further it is the only token allowed.
pub struct Constrained {
    inner: Box<dyn TokenSampler + Send>,
    matcher: Matcher,
    env: Arc<GrammarEnv>,
    masked: Vec<f32>,
    /// The step's logits of the end-of-generation tokens (`env.eog`), kept while the mask may hide them.
    end_logits: Vec<f32>,
}

impl Constrained {
    /// `inner` constrained by `matcher` (from [`GrammarEnv::matcher`] of the same `env`).
    pub fn new(inner: Box<dyn TokenSampler + Send>, matcher: Matcher, env: Arc<GrammarEnv>) -> Constrained {
        Constrained {
            inner,
            matcher,
            env,
            masked: Vec::new(),
            end_logits: Vec::new(),
        }
    }
}

impl TokenSampler for Constrained {
    fn next_token(&mut self, logits: StepLogits<'_>, history: &[u32]) -> u32 {
        self.masked.clear();
        match logits {
            StepLogits::Full(l) => self.masked.extend_from_slice(l),
            // `top_suffices` is false, so sessions give whole logits; were they ever only the best candidates,
            // the rest count as impossible.
            StepLogits::Top(top) => {
                let n = self.env.vocab;
                self.masked.resize(n, f32::NEG_INFINITY);
                for &(id, l) in &top.entries {
                    if let Some(x) = self.masked.get_mut(id as usize) {
                        *x = l;
                    }
                }
            }
        }
        self.end_logits.clear();
        self.end_logits.extend(
            self.env
                .eog
                .iter()
                .map(|&id| self.masked.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY)),
        );
        let end_allowed = if self.matcher.is_stopped() {
            // The grammar is complete and nothing may follow: only the end.
            self.masked.iter_mut().for_each(|l| *l = f32::NEG_INFINITY);
            true
        } else {
            self.mask_step()
        };
        self.finish_step(end_allowed, history)
    }

    fn adjusted_logits(&self) -> Option<&[f32]> {
        self.inner.adjusted_logits().or(Some(&self.masked))
    }
}

impl Constrained {
    /// Sets the logits the grammar forbids to -inf; says whether the end is allowed.
    fn mask_step(&mut self) -> bool {
        match self.matcher.compute_mask() {
            Ok(mask) => {
                for (id, l) in self.masked.iter_mut().enumerate() {
                    if !mask.is_allowed(id as u32) {
                        *l = f32::NEG_INFINITY;
                    }
                }
                mask.is_allowed(self.env.eos) || self.matcher.is_stopped()
            }
            // The matcher failed (a grammar past the engine's limits mid-answer): end the answer, and say why in
            // the log.
            Err(e) => {
                eprintln!("strata: the answer's grammar failed, so the answer ends here: {e}");
                self.masked.iter_mut().for_each(|l| *l = f32::NEG_INFINITY);
                true
            }
        }
    }

    /// Lets the end through where allowed, draws from the masked logits, and feeds the token to the grammar.
    fn finish_step(&mut self, end_allowed: bool, history: &[u32]) -> u32 {
        for (&id, &kept) in self.env.eog.iter().zip(&self.end_logits) {
            if let Some(l) = self.masked.get_mut(id as usize) {
                *l = if end_allowed { kept } else { f32::NEG_INFINITY };
            }
        }
        if end_allowed && self.masked.iter().all(|l| *l == f32::NEG_INFINITY) {
            // Nothing else may follow, and the model gives the end no probability: end anyway.
            self.masked[self.env.eos as usize] = 0.0;
        }
        let tok = self.inner.next_token(StepLogits::Full(&self.masked), history);
        if !self.env.eog.contains(&tok) {
            let _ = self.matcher.consume_token(tok);
        }
        tok
    }
}
