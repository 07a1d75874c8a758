//! `POST /v1/chat/completions`: the OpenAI-compatible chat route (streamed or whole).

use serde::Serialize;

use super::*;

/// Body of `POST /v1/chat/completions` (the fields ragkv uses; others are ignored).
#[derive(Debug, Deserialize)]
pub struct ChatBody {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub stream: Option<bool>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<u64>,
    /// ragkv extensions: chunks to retrieve, assembly strategy, fixed-length answers.
    pub ignore_eos: Option<bool>,
    pub top_k: Option<usize>,
    pub assembly: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Value,
}

pub(super) fn message_text(content: &Value) -> Option<String> {
    match content {
        Value::String(s) => Some(s.clone()),
        // [{"type": "text", "text": ...}, ...]
        Value::Array(parts) => Some(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        _ => None,
    }
}

pub(super) async fn chat(
    State(state): State<AppState>,
    p: UrlParams,
    body: Result<Json<ChatBody>, axum::extract::rejection::JsonRejection>,
) -> ApiResult<Response> {
    let UrlQuery(p) = p.map_err(rejected)?;
    let Json(b) = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    let question = b
        .messages
        .iter()
        .rev()
        .find(|m| m.role == "user")
        .and_then(|m| message_text(&m.content))
        .ok_or_else(|| ApiError::bad("messages: no user message with text content"))?;
    let q = build_query(
        &state.rag,
        question,
        b.top_k,
        GenOptions {
            max_tokens: b.max_completion_tokens.or(b.max_tokens),
            temperature: b.temperature,
            top_p: b.top_p,
            seed: b.seed,
            ignore_eos: b.ignore_eos,
        },
        kv_mode(p.kv.as_deref())?,
        assembly(&state.rag, p.assembly.as_deref().or(b.assembly.as_deref()))?,
        None,
    )?;
    let model = b.model.unwrap_or_else(|| "ragkv".into());
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let run = start(&state, q)?;
    if b.stream != Some(true) {
        let f = collect(run).await?;
        return Ok(Json(Completion {
            id: &id,
            object: "chat.completion",
            created,
            model: &model,
            choices: [Choice {
                index: 0,
                message: Said {
                    role: "assistant",
                    content: &f.answer,
                },
                finish_reason: openai_finish(&f.finish_reason),
            }],
            usage: Usage {
                prompt_tokens: f.prompt_tokens,
                completion_tokens: f.completion_tokens,
                total_tokens: f.prompt_tokens + f.completion_tokens,
            },
            ragkv: Extras::of(&f),
        })
        .into_response());
    }
    let stream = async_stream::stream! {
        let mut run = run;
        let chunk = |delta: Delta<'_>, finish: Option<&'static str>, ragkv: Option<Extras<'_>>| {
            let c = Chunk {
                id: &id,
                object: "chat.completion.chunk",
                created,
                model: &model,
                choices: [ChunkChoice { index: 0, delta, finish_reason: finish }],
                ragkv,
            };
            SseEvent::default().data(serde_json::to_string(&c).unwrap_or_default())
        };
        let first = Delta { role: Some("assistant"), content: Some("") };
        yield Ok::<_, Infallible>(chunk(first, None, None));
        while let Some(e) = run.next().await {
            match e {
                Event::Token(t) => {
                    yield Ok(chunk(Delta { role: None, content: Some(&t) }, None, None));
                }
                Event::Done(f) => {
                    let finish = openai_finish(&f.finish_reason);
                    yield Ok(chunk(Delta::default(), Some(finish), Some(Extras::of(&f))));
                    break;
                }
                Event::Error(kind, message) => {
                    let kind = ApiError::failed(kind, String::new()).kind();
                    let e = json!({"error": {"message": message, "type": kind}});
                    yield Ok(SseEvent::default().data(e.to_string()));
                    break;
                }
            }
        }
        yield Ok(SseEvent::default().data("[DONE]"));
    };
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// A whole answer (`chat.completion`).
#[derive(Serialize)]
struct Completion<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [Choice<'a>; 1],
    usage: Usage,
    /// ragkv's extension: where the context came from and how long each stage took.
    ragkv: Extras<'a>,
}

#[derive(Serialize)]
struct Choice<'a> {
    index: u32,
    message: Said<'a>,
    finish_reason: &'static str,
}

/// A message of the answer.
#[derive(Serialize)]
struct Said<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: usize,
    completion_tokens: usize,
    total_tokens: usize,
}

/// One streamed piece (`chat.completion.chunk`); the last one carries ragkv's extension.
#[derive(Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [ChunkChoice<'a>; 1],
    #[serde(skip_serializing_if = "Option::is_none")]
    ragkv: Option<Extras<'a>>,
}

#[derive(Serialize)]
struct ChunkChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    /// `null` until the last piece.
    finish_reason: Option<&'static str>,
}

/// What a piece adds: the role once, then text; empty in the last piece.
#[derive(Serialize, Default)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

/// ragkv's extension of an answer: citations, KV hits and misses, stage timings.
#[derive(Serialize)]
struct Extras<'a> {
    citations: &'a [crate::events::Citation],
    kv_hits: usize,
    kv_misses: usize,
    timings: &'a crate::events::Timings,
}

impl<'a> Extras<'a> {
    fn of(f: &'a Final) -> Extras<'a> {
        Extras {
            citations: &f.citations,
            kv_hits: f.kv_hits,
            kv_misses: f.kv_misses,
            timings: &f.timings,
        }
    }
}

pub(super) fn openai_finish(reason: &str) -> &'static str {
    match reason {
        "length" => "length",
        _ => "stop",
    }
}
