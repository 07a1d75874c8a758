//! Chat templates: the model's own Jinja template (GGUF metadata or `tokenizer_config.json`),
//! rendered with minijinja, or ChatML when the model has none or it does not render.

use serde::Serialize;

use crate::error::{Error, Result};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Renders `messages` with `template` and the generation prompt for the assistant's turn.
pub fn render(
    template: Option<&str>,
    messages: &[Message],
    bos: &str,
    eos: &str,
) -> Result<String> {
    if let Some(t) = template {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_template("chat", t)
            .map_err(|e| Error::Template { why: e.to_string() })?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| Error::Template { why: e.to_string() })?;
        match tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => bos,
            eos_token => eos,
        }) {
            Ok(s) => return Ok(s),
            Err(e) => tracing::warn!(error = %e, "chat template did not render; using ChatML"),
        }
    }
    Ok(chatml(messages))
}

/// The ChatML format SmolLM2 and Qwen2 use.
pub fn chatml(messages: &[Message]) -> String {
    let mut s = String::new();
    for m in messages {
        s.push_str(&format!(
            "<|im_start|>{}\n{}<|im_end|>\n",
            m.role, m.content
        ));
    }
    s.push_str("<|im_start|>assistant\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_jinja_template_and_falls_back_to_chatml() {
        let t = "{% for m in messages %}[{{ m.role }}]{{ m.content.strip() }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}";
        let msgs = [Message::new("user", " hi ")];
        assert_eq!(
            render(Some(t), &msgs, "", "").unwrap(),
            "[user]hi[assistant]"
        );
        assert_eq!(
            render(None, &msgs, "", "").unwrap(),
            "<|im_start|>user\n hi <|im_end|>\n<|im_start|>assistant\n"
        );
        // A template that fails to render falls back rather than failing the request.
        let broken = "{{ raise_exception('no') }}";
        assert!(render(Some(broken), &msgs, "", "")
            .unwrap()
            .starts_with("<|im_start|>"));
    }
}
