//! Constrained decoding on the default model (issue 18, point 2): whatever the model would have said, the answer
//! parses and validates against the JSON schema or the grammar it was given; greedy and sampled alike; an
//! unenforceable schema is refused naming the keyword.

use std::sync::Arc;

use serde_json::{Value, json};
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::model::Model;
use strata_engine::models;
use strata_engine::runtime::generate::{GenerateOptions, Greedy, StopReason, TokenSampler, generate};
use strata_engine::runtime::grammar::{Constrained, GrammarEnv, GrammarSpec, RecentGrammars};
use strata_engine::runtime::sampling::{Sampler, SamplingParams};
use strata_engine::runtime::session::{Session, SessionConfig};
use strata_engine::state::kv::KvType;
use strata_engine::tokenizer::{ChatMessage, ChatRequest, ChatTemplate, Tokenizer};

fn run(
    model: &Model,
    tok: &Tokenizer,
    env: &Arc<GrammarEnv>,
    spec: &GrammarSpec,
    ask: &str,
    inner: Box<dyn TokenSampler + Send>,
) -> (String, StopReason) {
    run_with(model, tok, env, env.matcher(spec).unwrap(), ask, inner)
}

/// [`run`] under a matcher made elsewhere.
fn run_with(
    model: &Model,
    tok: &Tokenizer,
    env: &Arc<GrammarEnv>,
    matcher: llguidance::Matcher,
    ask: &str,
    inner: Box<dyn TokenSampler + Send>,
) -> (String, StopReason) {
    let template = ChatTemplate::from_metadata(model.gguf.metadata()).unwrap().unwrap();
    let request = ChatRequest {
        messages: vec![ChatMessage::new("user", ask)],
        add_generation_prompt: true,
        ..ChatRequest::default()
    };
    let ids = template.prompt(tok, &request).unwrap().ids;
    let config = SessionConfig {
        max_context: 1024,
        kv: KvType::F16,
        prefill_chunk: None,
    };
    let mut session = Session::new(model, &CpuBackend, config).unwrap();
    let mut sampler = Constrained::new(inner, matcher, env.clone());
    let opts = GenerateOptions {
        max_tokens: 200,
        stop: vec![],
        logits_digest: false,
        logprobs: None,
    };
    let mut text = String::new();
    let (_, stats) = generate(&mut session, tok, &ids, &opts, &mut sampler, &mut |t| text.push_str(t)).unwrap();
    (text, stats.stop)
}

#[test]
fn constrained_answers_parse_and_validate() {
    let model = Model::load(models::require(models::DEFAULT_MODEL_FILE).unwrap_or_else(|e| panic!("{e}"))).unwrap();
    let tok = Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let env = Arc::new(GrammarEnv::new(&tok).unwrap());
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "colour": {"enum": ["black", "white", "ginger"]}
        },
        "required": ["name", "age", "colour"],
        "additionalProperties": false
    });
    let spec = GrammarSpec::JsonSchema { schema };
    let samplers: Vec<Box<dyn TokenSampler + Send>> = vec![
        Box::new(Greedy),
        Box::new(
            Sampler::new(
                SamplingParams {
                    temperature: 1.5,
                    seed: Some(3),
                    ..SamplingParams::default()
                },
                tok.vocab_size(),
            )
            .unwrap(),
        ),
    ];
    for inner in samplers {
        let (text, stop) = run(&model, &tok, &env, &spec, "Describe a cat.", inner);
        assert_eq!(stop, StopReason::Eog, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 3, "{text}");
        assert!(o["name"].as_str().unwrap().chars().count() <= 20);
        assert!((0..=30).contains(&o["age"].as_i64().unwrap()), "{text}");
        assert!(["black", "white", "ginger"].contains(&o["colour"].as_str().unwrap()));
    }

    // A Lark grammar.
    let spec = GrammarSpec::Lark {
        grammar: "start: \"yes\" | \"no\"".into(),
    };
    let (text, _) = run(
        &model,
        &tok,
        &env,
        &spec,
        "Is the sky blue? Answer yes or no.",
        Box::new(Greedy),
    );
    assert!(text == "yes" || text == "no", "{text:?}");

    // What the engine cannot enforce is refused, naming the part.
    let bad = GrammarSpec::JsonSchema {
        schema: json!({"type": "object", "properties": {"a": {"type": "strin"}}}),
    };
    let err = env.check(&bad).unwrap_err().to_string();
    assert!(err.contains("strin"), "{err}");
}

/// A spec seen again among the last few (a request's `n` choices, a schema sent request after request) is compiled
/// once: its clones give the answer a fresh compile gives, each from the answer's start however far another clone
/// went; a fifth spec pushes out the oldest.
#[test]
fn recent_grammars_compile_a_spec_once_and_clone_it_from_the_start() {
    let model = Model::load(models::require(models::DEFAULT_MODEL_FILE).unwrap_or_else(|e| panic!("{e}"))).unwrap();
    let tok = Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let env = Arc::new(GrammarEnv::new(&tok).unwrap());
    let schema = |n: usize| GrammarSpec::JsonSchema {
        schema: json!({
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12 + n}, "legs": {"type": "integer"}},
            "required": ["name", "legs"],
            "additionalProperties": false
        }),
    };
    let ask = "Describe a cat.";
    let (want, stop) = run(&model, &tok, &env, &schema(0), ask, Box::new(Greedy));
    assert_eq!(stop, StopReason::Eog, "{want}");
    let mut recent = RecentGrammars::default();
    let first = recent.matcher(&env, &schema(0)).unwrap();
    let second = recent.matcher(&env, &schema(0)).unwrap();
    assert_eq!(recent.compiles(), 1, "the same spec again was compiled again");
    // The compiled matcher runs a whole answer; the clone, after it, still starts at the beginning.
    for m in [first, second] {
        let (got, _) = run_with(&model, &tok, &env, m, ask, Box::new(Greedy));
        assert_eq!(
            got, want,
            "a kept grammar's clone answers otherwise than a fresh compile"
        );
    }
    // Three more specs keep the first (4 kept); a fifth pushes out the least recently used, schema(1).
    let lark = GrammarSpec::Lark {
        grammar: "start: \"yes\" | \"no\"".into(),
    };
    for spec in [&schema(1), &schema(2), &lark, &schema(0)] {
        recent.matcher(&env, spec).unwrap();
    }
    assert_eq!(recent.compiles(), 4, "schema(0), still kept, was compiled again");
    recent.matcher(&env, &schema(3)).unwrap();
    recent.matcher(&env, &lark).unwrap();
    assert_eq!(recent.compiles(), 5);
    recent.matcher(&env, &schema(1)).unwrap();
    assert_eq!(
        recent.compiles(),
        6,
        "the oldest spec was still kept past four newer ones"
    );
    // A spec that does not compile is refused each time, and kept never.
    let bad = GrammarSpec::JsonSchema {
        schema: json!({"type": "object", "properties": {"a": {"type": "strin"}}}),
    };
    for _ in 0..2 {
        let Err(err) = recent.matcher(&env, &bad) else {
            panic!("an unenforceable schema compiled");
        };
        let err = err.to_string();
        assert!(err.contains("strin"), "{err}");
    }
    assert_eq!(recent.compiles(), 6);
    // What a clone saves: a schema of 1,000 optional properties, compiled, then cloned (printed, not judged).
    let props: serde_json::Map<String, Value> = (0..1000)
        .map(|i| (format!("p{i}"), json!({"type": "integer"})))
        .collect();
    let big = GrammarSpec::JsonSchema {
        schema: json!({"type": "object", "properties": props, "additionalProperties": false}),
    };
    let t = std::time::Instant::now();
    recent.matcher(&env, &big).unwrap();
    let compiled = t.elapsed();
    let t = std::time::Instant::now();
    recent.matcher(&env, &big).unwrap();
    println!(
        "a schema of 1,000 properties: compiled in {:.1} ms, cloned in {:.2} ms",
        compiled.as_secs_f64() * 1e3,
        t.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(recent.compiles(), 7);
    // That schema's answer goes past its `{` (llguidance's default row limit of 2,000 items ended it there).
    let (text, stop) = run_with(
        &model,
        &tok,
        &env,
        recent.matcher(&env, &big).unwrap(),
        "Give p3 the value 7.",
        Box::new(Greedy),
    );
    assert!(text.len() > 1, "the answer ended at {text:?}");
    if stop == StopReason::Eog {
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(v.is_object(), "{text}");
    }
    // The same properties in another order are another spec: the answer writes them in the schema's order.
    let ordered = |names: [&str; 2]| GrammarSpec::JsonSchema {
        schema: json!({"type": "object", "properties": {names[0]: {"type": "integer"}, names[1]: {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": false}),
    };
    let (ab, ba) = (ordered(["a", "b"]), ordered(["b", "a"]));
    let mut answers = Vec::new();
    for spec in [&ab, &ba] {
        let (text, _) = run_with(
            &model,
            &tok,
            &env,
            recent.matcher(&env, spec).unwrap(),
            ask,
            Box::new(Greedy),
        );
        answers.push(text);
    }
    assert_eq!(
        recent.compiles(),
        9,
        "a schema with its properties reordered took another's grammar"
    );
    let first_key = |t: &str| t.find("\"a\"").zip(t.find("\"b\"")).map(|(a, b)| a < b);
    assert_eq!(first_key(&answers[0]), Some(true), "{answers:?}");
    assert_eq!(first_key(&answers[1]), Some(false), "{answers:?}");
}

/// The front compiles a spec it has found enforceable once: sent again (request after request), it is taken as
/// checked; an unenforceable one is compiled (and refused) each time; past 16 newer specs the first is compiled again.
#[test]
fn the_front_checks_a_schema_sent_again_without_compiling_it() {
    use strata_engine::serve::api::{Api, GRAMMARS_CHECKED, ModelInfo};
    let path = models::require(models::DEFAULT_MODEL_FILE).unwrap_or_else(|e| panic!("{e}"));
    let info = ModelInfo::open(&path, 1024, None).unwrap();
    let schema = |n: usize| GrammarSpec::JsonSchema {
        schema: json!({"type": "object", "properties": {"n": {"type": "integer", "maximum": n}}}),
    };
    for _ in 0..3 {
        info.check_grammar(Api::OpenAi, "response_format", &schema(0)).unwrap();
    }
    assert_eq!(
        info.grammar_compiles(),
        1,
        "a schema found enforceable was compiled again"
    );
    let bad = GrammarSpec::JsonSchema {
        schema: json!({"anyOf": [{"$ref": "#"}]}),
    };
    for _ in 0..2 {
        let err = info.check_grammar(Api::OpenAi, "response_format", &bad).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("response_format"), "{}", err.message);
        assert!(err.message.contains("no JSON value"), "{}", err.message);
    }
    assert_eq!(info.grammar_compiles(), 3);
    for n in 1..=GRAMMARS_CHECKED {
        info.check_grammar(Api::OpenAi, "response_format", &schema(n)).unwrap();
    }
    assert_eq!(info.grammar_compiles(), 3 + GRAMMARS_CHECKED);
    info.check_grammar(Api::OpenAi, "response_format", &schema(GRAMMARS_CHECKED))
        .unwrap();
    assert_eq!(info.grammar_compiles(), 3 + GRAMMARS_CHECKED);
    info.check_grammar(Api::OpenAi, "response_format", &schema(0)).unwrap();
    assert_eq!(
        info.grammar_compiles(),
        4 + GRAMMARS_CHECKED,
        "the oldest spec was kept past 16 newer ones"
    );
}

/// A spec of more than `RecentGrammars::KEY_MAX` bytes (megabytes of `default`, which the compiler ignores) compiles
/// and answers, but is not kept: sent again, it is compiled again.
#[test]
fn recent_grammars_keep_no_spec_past_their_size_limit() {
    let model = Model::load(models::require(models::DEFAULT_MODEL_FILE).unwrap_or_else(|e| panic!("{e}"))).unwrap();
    let tok = Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let env = Arc::new(GrammarEnv::new(&tok).unwrap());
    let zeros = vec![0u8; RecentGrammars::KEY_MAX / 2 + 1];
    let big = GrammarSpec::JsonSchema {
        schema: json!({"type": "integer", "default": zeros}),
    };
    let mut recent = RecentGrammars::default();
    for _ in 0..2 {
        recent.matcher(&env, &big).unwrap();
    }
    assert_eq!(recent.compiles(), 2, "a spec past the size limit was kept");
    let small = GrammarSpec::JsonSchema {
        schema: json!({"type": "integer"}),
    };
    for _ in 0..2 {
        recent.matcher(&env, &small).unwrap();
    }
    assert_eq!(recent.compiles(), 3);
}
