//! What both synthetic model writers (`synthetic.rs`, `synthetic_shape.rs`) put
//! in a GGUF file besides tensors: each family's special tokens and chat template, the
//! byte-level vocabulary, and the metadata keys (llama.cpp's names).

use candle_core::quantized::gguf_file::Value;

use crate::config::Arch;

/// The family's special tokens (the first is BOS, the second EOS, the third ends a turn),
/// its GGUF pre-tokenizer name and its chat template.
pub(crate) fn family(arch: Arch) -> (&'static [&'static str], &'static str, &'static str) {
    match arch {
        Arch::Llama => (
            &[
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|eot_id|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
            ],
            "llama-bpe",
            LLAMA3_TEMPLATE,
        ),
        Arch::Mistral => (
            &["<s>", "</s>", "</s>", "[INST]", "[/INST]"],
            "gpt2",
            MISTRAL_TEMPLATE,
        ),
        Arch::Qwen2 | Arch::Qwen3 => (
            &[
                "<|endoftext|>",
                "<|endoftext|>",
                "<|im_end|>",
                "<|im_start|>",
            ],
            "qwen2",
            CHATML_TEMPLATE,
        ),
        Arch::Gemma3 => (
            &["<bos>", "<eos>", "<end_of_turn>", "<start_of_turn>"],
            "gpt2",
            crate::template::GEMMA3_TEMPLATE,
        ),
    }
}

/// Llama 3.1's template, shortened (no tools): BOS, header ids, `<|eot_id|>`.
const LLAMA3_TEMPLATE: &str = "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";
/// Mistral Instruct v0.3's template, shortened: the system prompt goes into the last user turn.
const MISTRAL_TEMPLATE: &str = "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}{%- endif %}{%- endfor %}";
/// ChatML, as Qwen2.5 and Qwen3 write it (without tools or thinking).
const CHATML_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// GPT-2's byte-to-symbol table: the symbol each byte value gets in a byte-level vocabulary.
pub(crate) fn byte_symbols() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut n = 0;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("latin-1")
            } else {
                n += 1;
                char::from_u32(255 + n).expect("shifted")
            }
        })
        .collect()
}

/// A decoder's shape, as its GGUF metadata states it.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    /// Preset name (`qwen2.5-0.5b`).
    pub name: &'static str,
    /// Model family.
    pub arch: Arch,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads per layer.
    pub heads: usize,
    /// Key/value heads per layer.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Width of the feed-forward's hidden layer.
    pub intermediate: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// Context length the metadata states.
    pub context: usize,
}

/// A byte-level BPE vocabulary, as a GGUF file states it.
pub(crate) struct Vocab {
    pub tokens: Vec<String>,
    /// llama.cpp token types (1 normal, 3 control).
    pub types: Vec<i32>,
    pub merges: Vec<String>,
    pub bos: u32,
    pub eos: u32,
}

/// The byte-level vocabulary both writers use: the 256 byte symbols, 4 merges and the tokens
/// they make, each distinct token of `specials` (control type), then normal filler tokens
/// `<|fill_N|>` up to `size` tokens. BOS and EOS are `specials[0]` and `specials[1]`; the
/// second value is the id of every token of `specials`, in order.
pub(crate) fn byte_vocab(specials: &[&str], size: usize) -> (Vocab, Vec<u32>) {
    let symbols = byte_symbols();
    let space = symbols[b' ' as usize];
    let mut tokens: Vec<String> = symbols.iter().map(|c| c.to_string()).collect();
    let merges: Vec<String> = vec![
        format!("{space} t"),
        "h e".into(),
        format!("{space}t he"),
        "i n".into(),
    ];
    tokens.extend(merges.iter().map(|m| m.replace(' ', "")));
    let mut types = vec![1i32; tokens.len()];
    let mut ids = Vec::with_capacity(specials.len());
    for sp in specials {
        if let Some(i) = tokens.iter().position(|t| t == sp) {
            ids.push(i as u32);
        } else {
            ids.push(tokens.len() as u32);
            tokens.push(sp.to_string());
            types.push(3);
        }
    }
    let mut n = 0;
    while tokens.len() < size {
        tokens.push(format!("<|fill_{n}|>"));
        types.push(1);
        n += 1;
    }
    let vocab = Vocab {
        tokens,
        types,
        merges,
        bos: ids[0],
        eos: ids[1],
    };
    (vocab, ids)
}

/// llama.cpp's `general.architecture` of a family.
pub(crate) fn gguf_arch(arch: Arch) -> &'static str {
    match arch {
        Arch::Llama | Arch::Mistral => "llama",
        Arch::Qwen2 => "qwen2",
        Arch::Qwen3 => "qwen3",
        Arch::Gemma3 => "gemma3",
    }
}

/// The GGUF metadata of a model of shape `s` (llama.cpp's keys), unsorted: the synthetic
/// writers add their family's extras, then sort.
pub(crate) fn gguf_metadata(
    s: &Shape,
    vocab: &Vocab,
    pre: &str,
    template: &str,
) -> Vec<(String, Value)> {
    let gguf_arch = gguf_arch(s.arch);
    let k = |key: &str| format!("{gguf_arch}.{key}");
    let strings = |v: &[String]| Value::Array(v.iter().cloned().map(Value::String).collect());
    let u = |x: usize| Value::U32(x as u32);
    vec![
        (
            "general.architecture".into(),
            Value::String(gguf_arch.into()),
        ),
        (
            "general.name".into(),
            Value::String(format!("synthetic {}", s.name)),
        ),
        (k("context_length"), u(s.context)),
        (k("embedding_length"), u(s.hidden)),
        (k("block_count"), u(s.layers)),
        (k("feed_forward_length"), u(s.intermediate)),
        (k("attention.head_count"), u(s.heads)),
        (k("attention.head_count_kv"), u(s.kv_heads)),
        (k("attention.key_length"), u(s.head_dim)),
        (k("attention.value_length"), u(s.head_dim)),
        (k("rope.dimension_count"), u(s.head_dim)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (k("rope.freq_base"), Value::F32(s.rope_theta)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".into(), strings(&vocab.tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(vocab.types.iter().map(|t| Value::I32(*t)).collect()),
        ),
        ("tokenizer.ggml.merges".into(), strings(&vocab.merges)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(vocab.bos)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(vocab.eos)),
        (
            "tokenizer.ggml.add_bos_token".into(),
            Value::Bool(matches!(s.arch, Arch::Llama | Arch::Mistral | Arch::Gemma3)),
        ),
        (
            "tokenizer.chat_template".into(),
            Value::String(template.into()),
        ),
    ]
}
