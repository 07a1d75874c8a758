//! `ragkv bench model`: ragkv's decoder against candle-transformers' stock Llama on the same
//! weights (our GGUF load, exported in HF layout and handed to the stock model through a
//! `VarBuilder`), plus KV export/import throughput.
//!
//! Both run f32 on the same device and thread pool; each figure is the median of `--reps`
//! runs after one warm-up run.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Tensor};
use candle_transformers::models::llama as stock;
use model::{Kv, LoadOptions, Logits, Model, ModelSource};

use crate::{Error, Line};

/// Arguments of `ragkv bench model`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// GGUF file or HF directory (default: the SmolLM2 file fetched by scripts/setup.sh).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt length for prefill.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens decoded after the prompt.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Timed repetitions (median reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Compute device for both decoders: cpu, cuda or cuda:N (CUDA needs `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

pub(crate) fn merr(e: model::Error) -> Error {
    Error::Check(format!("model: {e}"))
}

fn cerr(e: candle_core::Error) -> Error {
    Error::Check(format!("candle: {e}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    let path = args
        .model
        .clone()
        .unwrap_or_else(|| model::models_dir().join(model::SMOLLM2_FILE));
    let source = ModelSource::from_path(&path).map_err(merr)?;
    let device = model::device(&args.device).map_err(merr)?;
    let opts = LoadOptions {
        device: device.clone(),
        ..LoadOptions::default()
    };
    let ours = Model::load(&source, &opts).map_err(merr)?;
    // Timings end when the device has finished the work (a no-op on the CPU).
    let sync = || device.synchronize().map_err(cerr);
    if ours.config().arch != model::Arch::Llama {
        return Err(Error::Invalid {
            what: "--model",
            why: "the stock comparison runs candle-transformers' llama: pass a Llama-family model"
                .into(),
        });
    }
    let dir = tempfile::tempdir().map_err(crate::io("temporary directory"))?;
    ours.export_hf(dir.path()).map_err(merr)?;
    let cfg_text = std::fs::read_to_string(dir.path().join("config.json"))
        .map_err(crate::io("config.json"))?;
    let stock_cfg: stock::LlamaConfig =
        serde_json::from_str(&cfg_text).map_err(|e| Error::Check(format!("stock config: {e}")))?;
    let stock_cfg = stock_cfg.into_config(false);
    let tensors = candle_core::safetensors::load(dir.path().join("model.safetensors"), &device)
        .map_err(cerr)?;
    let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &device);
    let stock_model = stock::Llama::load(vb, &stock_cfg).map_err(cerr)?;

    // A prompt of real text, repeated to length.
    let text = "Retrieval-augmented generation keeps the key/value cache of every document chunk on flash, \
                so that answering a question costs a read instead of a prefill. ";
    let mut prompt = Vec::new();
    while prompt.len() < args.prompt_tokens {
        prompt.extend(ours.tokenizer().encode(text).map_err(merr)?);
    }
    prompt.truncate(args.prompt_tokens);
    let n = prompt.len();

    let mut ours_prefill = Vec::new();
    let mut ours_decode = Vec::new();
    let mut stock_prefill = Vec::new();
    let mut stock_decode = Vec::new();
    let mut agree = true;
    for rep in 0..=args.reps {
        // Ours.
        let mut cache = ours.new_cache(n + args.decode_tokens).map_err(merr)?;
        let t = Instant::now();
        let mut logits = ours
            .decoder()
            .forward(&mut cache, &prompt, Logits::Last)
            .map_err(merr)?;
        sync()?;
        let p = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut ours_tokens = Vec::new();
        for _ in 0..args.decode_tokens {
            let next = model::Decoder::argmax(&logits).map_err(merr)?;
            ours_tokens.push(next);
            logits = ours
                .decoder()
                .forward(&mut cache, &[next], Logits::Last)
                .map_err(merr)?;
        }
        let d = t.elapsed().as_secs_f64() / args.decode_tokens.max(1) as f64;

        // Stock.
        let mut scache = stock::Cache::new(true, DType::F32, &stock_cfg, &device).map_err(cerr)?;
        let input = Tensor::new(prompt.as_slice(), &device)
            .and_then(|t| t.unsqueeze(0))
            .map_err(cerr)?;
        let t = Instant::now();
        let mut slogits = stock_model.forward(&input, 0, &mut scache).map_err(cerr)?;
        sync()?;
        let sp = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut stock_tokens = Vec::new();
        for i in 0..args.decode_tokens {
            let next = model::Decoder::argmax(&slogits.squeeze(0).map_err(cerr)?).map_err(merr)?;
            stock_tokens.push(next);
            let input = Tensor::new(&[next], &device)
                .and_then(|t| t.unsqueeze(0))
                .map_err(cerr)?;
            slogits = stock_model
                .forward(&input, n + i, &mut scache)
                .map_err(cerr)?;
        }
        let sd = t.elapsed().as_secs_f64() / args.decode_tokens.max(1) as f64;
        agree &= ours_tokens == stock_tokens;
        if rep > 0 {
            ours_prefill.push(n as f64 / p);
            ours_decode.push(d * 1e3);
            stock_prefill.push(n as f64 / sp);
            stock_decode.push(sd * 1e3);
        }
        eprintln!(
            "rep {rep}: ours {:.0} tok/s, {:.1} ms/tok; stock {:.0} tok/s, {:.1} ms/tok",
            n as f64 / p,
            d * 1e3,
            n as f64 / sp,
            sd * 1e3
        );
    }
    if !agree {
        eprintln!("warning: greedy tokens of ours and stock differ");
    }

    // KV export / import.
    let (kv, _) = ours.prefill(&prompt, 0).map_err(merr)?;
    let layout = ours.kv_layout().map_err(merr)?;
    let mut export = Vec::new();
    let mut import = Vec::new();
    let mut copy = Vec::new();
    for _ in 0..args.reps.max(1) {
        let t = Instant::now();
        let bytes = kv.to_bytes(DType::F32).map_err(merr)?;
        export.push(bytes.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
        let t = Instant::now();
        let back = Kv::from_bytes(&bytes, &layout, &device).map_err(merr)?;
        sync()?;
        import.push(bytes.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
        std::hint::black_box(back);
        // The upper bound: one copy of the same bytes into a fresh buffer.
        let t = Instant::now();
        let c = bytes.to_vec();
        copy.push(c.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
        std::hint::black_box(c);
    }
    let stock_name = "candle-transformers llama (same weights, f32)";
    Ok(vec![
        Line::higher(
            "model.prefill",
            median(ours_prefill),
            median(stock_prefill),
            "tokens/s",
            stock_name,
        )
        .bar(0.9),
        Line::lower(
            "model.decode",
            median(ours_decode),
            median(stock_decode),
            "ms/token",
            stock_name,
        )
        .bar(1.0),
        Line::higher(
            "model.kv_export",
            median(export),
            median(copy.clone()),
            "GB/s",
            "memcpy of the same bytes",
        ),
        Line::higher(
            "model.kv_import",
            median(import),
            median(copy),
            "GB/s",
            "memcpy of the same bytes",
        ),
    ])
}
