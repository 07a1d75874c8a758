//! `POST /v1/chat/completions`: the OpenAI-compatible chat route (streamed or whole).

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
        return Ok(Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f.answer},
                         "finish_reason": openai_finish(&f.finish_reason)}],
            "usage": {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
                      "total_tokens": f.prompt_tokens + f.completion_tokens},
            "ragkv": {"citations": f.citations, "kv_hits": f.kv_hits, "kv_misses": f.kv_misses,
                      "timings": f.timings},
        }))
        .into_response());
    }
    let stream = async_stream::stream! {
        let mut run = run;
        let chunk = |delta: Value, finish: Value| json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        });
        yield Ok::<_, Infallible>(SseEvent::default().data(chunk(json!({"role": "assistant", "content": ""}), Value::Null).to_string()));
        while let Some(e) = run.next().await {
            match e {
                Event::Token(t) => {
                    yield Ok(SseEvent::default().data(chunk(json!({"content": t}), Value::Null).to_string()));
                }
                Event::Done(f) => {
                    let mut last = chunk(json!({}), json!(openai_finish(&f.finish_reason)));
                    last["ragkv"] = json!({"citations": f.citations, "kv_hits": f.kv_hits,
                                           "kv_misses": f.kv_misses, "timings": f.timings});
                    yield Ok(SseEvent::default().data(last.to_string()));
                    break;
                }
                Event::Error(kind, e) => {
                    let kind = ApiError::failed(kind, String::new()).kind();
                    yield Ok(SseEvent::default().data(json!({"error": {"message": e, "type": kind}}).to_string()));
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

pub(super) fn openai_finish(reason: &str) -> &'static str {
    match reason {
        "length" => "length",
        _ => "stop",
    }
}
