//! `ragkv bench model`: ragkv's decoder against llama.cpp's `llama-bench` on the same GGUF file
//! and thread count (prefill of `--prompt-tokens`, decode of `--decode-tokens`, each llama-bench
//! run interleaved with ours so that both see the same machine), the resident memory of the
//! loaded model against the file's size, and for Llama-family models candle-transformers'
//! stock Llama on the same weights (f32, exported in HF layout); plus KV export/import
//! throughput.
//!
//! On a GPU (`--device cuda`) llama-bench offloads every layer (`-ngl`), host memory is not
//! reported, and one more line checks the GPU's greedy tokens against the CPU path's on the
//! same file (`model.device_tokens_vs_cpu`). `--synthetic SHAPE:TYPE` benchmarks a
//! random-weight file of a real model's shape instead of a downloaded one.
//!
//! Each figure is the median of `--reps` runs after one warm-up run. Our decode continues
//! after the prompt (attention over `--prompt-tokens` keys); llama-bench's decode is measured
//! at the same depth (`-d`), its prefill from an empty context, as ours. Our KV cache is f16
//! on the CPU by default (`--cache`), as `ragkv serve` decodes (`serve.cache_dtype`) and as
//! llama.cpp keeps its own.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Tensor};
use candle_transformers::models::llama as stock;
use model::{Kv, LoadOptions, Logits, Model, ModelSource};

use crate::{median, Error, Line};

mod fidelity;

/// Arguments of `ragkv bench model`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// GGUF file or HF directory; repeat it to compare several models in one run, one set
    /// of lines per model (default: the SmolLM2 file fetched by scripts/setup.sh).
    #[arg(long)]
    pub model: Vec<PathBuf>,
    /// A random-weight GGUF of a real model's shape, `SHAPE:TYPE` (`qwen2.5-0.5b:q8_0`;
    /// shapes: smollm2-135m, qwen2.5-0.5b, llama-3.2-1b, qwen2.5-1.5b), written into
    /// `--synthetic-dir` unless already there and benchmarked like a `--model` (timings are the
    /// real model's; the answers are noise). Repeatable.
    #[arg(long, value_name = "SHAPE:TYPE")]
    pub synthetic: Vec<String>,
    /// Where `--synthetic` files are written (default: `synthetic/` in the models directory).
    #[arg(long)]
    pub synthetic_dir: Option<PathBuf>,
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
    /// llama.cpp's llama-bench (default: the one scripts/llama-server.sh builds into the
    /// cache). Without it the llama.cpp lines are left out, with a note.
    #[arg(long)]
    pub llama_bench: Option<PathBuf>,
    /// Threads for llama-bench (ours use every CPU the process may: set RAYON_NUM_THREADS
    /// to change both).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Dequantize GGUF weights at load (the reference path) instead of keeping them quantized.
    #[arg(long)]
    pub dequantized: bool,
    /// Leave out the stock candle-transformers comparison (quicker; a profile of the run
    /// then shows only ours).
    #[arg(long)]
    pub no_stock: bool,
    /// Our decoding cache on the CPU: `f16` (what `ragkv serve` decodes with, and llama.cpp's
    /// own cache type) or `f32` (the library's default; figures recorded before 2026-11-26).
    #[arg(long, default_value = "f16", value_parser = ["f16", "f32"])]
    pub cache: String,
    /// Also score the quantized path against the dequantized reference (f32 weights and
    /// activations) on the first `--prompt-tokens` tokens of this text file: the share of
    /// positions whose greedy next token is the reference's (`model.quantized_agreement`) and
    /// the mean KL of the next-token distributions. A GGUF on the CPU only; loads the f32
    /// weights too (about 4x the file in memory).
    #[arg(long, value_name = "TEXT_FILE")]
    pub fidelity: Option<PathBuf>,
}

/// Resident set size of this process, bytes (Linux; 0 elsewhere).
fn rss_bytes() -> usize {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page.max(0) as usize
}

pub(crate) fn merr(e: model::Error) -> Error {
    Error::Check(format!("model: {e}"))
}

fn cerr(e: candle_core::Error) -> Error {
    Error::Check(format!("candle: {e}"))
}

/// Runs the benchmark for each model in turn. Every line's `detail` names its model file and
/// the kernel path the run used (`model.kernels`, resolved on this CPU).
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    let mut paths = args.model.clone();
    for spec in &args.synthetic {
        let dir = args
            .synthetic_dir
            .clone()
            .unwrap_or_else(|| model::models_dir().join("synthetic"));
        paths.push(synthetic(spec, &dir)?);
    }
    if paths.is_empty() {
        paths.push(model::models_dir().join(model::SMOLLM2_FILE));
    }
    let kernels = model::kernel_path().resolved();
    let mut lines = Vec::new();
    for path in paths {
        eprintln!("model {} (kernels: {kernels})", path.display());
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        for mut line in run_one(args, path)? {
            let mut detail = serde_json::json!({"model": name, "kernels": kernels.name()});
            if let Some(serde_json::Value::Object(own)) = line.detail.take() {
                detail.as_object_mut().expect("an object").extend(own);
            }
            line.detail = Some(detail);
            lines.push(line);
        }
    }
    Ok(lines)
}

/// The file of `SHAPE:TYPE` in `dir`, written first unless it is already there.
pub fn synthetic(spec: &str, dir: &std::path::Path) -> Result<PathBuf, Error> {
    let (name, ty) = spec.split_once(':').ok_or_else(|| {
        Error::Check(format!(
            "--synthetic {spec:?}: expected SHAPE:TYPE, e.g. qwen2.5-0.5b:q8_0"
        ))
    })?;
    let shape = model::shape_preset(name).map_err(merr)?;
    let dtype = model::block_type(ty).map_err(merr)?;
    let path = dir.join(format!("{name}-{}.gguf", ty.to_ascii_lowercase()));
    if !path.exists() {
        let t = Instant::now();
        model::write_shaped(shape, dtype, &path, 7).map_err(merr)?;
        eprintln!(
            "wrote {} ({:.0} MB) in {:.1} s",
            path.display(),
            std::fs::metadata(&path).map_or(0.0, |m| m.len() as f64 / 1e6),
            t.elapsed().as_secs_f64()
        );
    }
    Ok(path)
}

fn run_one(args: &Args, path: PathBuf) -> Result<Vec<Line>, Error> {
    let source = ModelSource::from_path(&path).map_err(merr)?;
    let device = model::device(&args.device).map_err(merr)?;
    let opts = LoadOptions {
        device: device.clone(),
        quantized: !args.dequantized,
        ..LoadOptions::default()
    };
    // The previous model's freed memory goes back to the system first, so that this model's
    // matrices cannot reuse it and look smaller than they are. (Pinning glibc's mmap threshold
    // instead made every large temporary a fresh mapping: prefill ran 2.8x slower.)
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }
    let rss_before = rss_bytes();
    let ours = Model::load(&source, &opts).map_err(merr)?;
    let loaded_bytes = rss_bytes().saturating_sub(rss_before);
    let file_bytes = std::fs::metadata(&path)
        .map_err(crate::io(path.display().to_string()))?
        .len() as f64;
    // Timings end when the device has finished the work (a no-op on the CPU).
    let sync = || device.synchronize().map_err(cerr);
    let llama_bench = match (
        &source,
        crate::llama::binary(args.llama_bench.as_deref(), "llama-bench"),
    ) {
        (ModelSource::Gguf(_), Ok(bin)) => Some(bin),
        (ModelSource::Gguf(_), Err(e)) => {
            eprintln!("note: no llama.cpp comparison: {e}");
            None
        }
        (ModelSource::HfDir(_), _) => None,
    };
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let stock = if args.no_stock {
        None
    } else if ours.config().arch == model::Arch::Llama {
        Some(load_stock(&ours, &device)?)
    } else {
        eprintln!("note: the stock candle-transformers comparison runs Llama-family models only");
        None
    };

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
    let mut llama_prefill = Vec::new();
    let mut llama_decode = Vec::new();
    let mut agree = true;
    let mut last_tokens = Vec::new();
    // llama-bench offloads every layer on a GPU run, none on a CPU one.
    let gpu_layers = if device.is_cpu() { 0 } else { 999 };
    for rep in 0..=args.reps {
        // Ours.
        let mut cache = if device.is_cpu() && args.cache == "f16" {
            let c = ours.config();
            model::KvCache::new(
                c.layers,
                c.kv_heads,
                c.head_dim,
                n + args.decode_tokens,
                DType::F16,
                &device,
            )
        } else {
            ours.decoder().new_cache(n + args.decode_tokens)
        }
        .map_err(merr)?;
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
        sync()?;
        let d = t.elapsed().as_secs_f64() / args.decode_tokens.max(1) as f64;
        last_tokens = ours_tokens.clone();

        if let Some((stock_model, stock_cfg)) = &stock {
            let (sp, sd, stock_tokens) =
                run_stock(stock_model, stock_cfg, &device, &prompt, args.decode_tokens)?;
            agree &= ours_tokens == stock_tokens;
            if rep > 0 {
                stock_prefill.push(n as f64 / sp);
                stock_decode.push(sd * 1e3);
            }
        }
        if let (Some(bin), true) = (&llama_bench, rep > 0) {
            let f =
                crate::llama::bench(bin, &path, n, args.decode_tokens, n, threads, gpu_layers, 1)?;
            eprintln!(
                "rep {rep}: llama.cpp {:.0} tok/s, {:.1} ms/tok",
                f.prefill,
                1e3 / f.decode
            );
            llama_prefill.push(f.prefill);
            llama_decode.push(1e3 / f.decode);
        }
        if rep > 0 {
            ours_prefill.push(n as f64 / p);
            ours_decode.push(d * 1e3);
        }
        eprintln!(
            "rep {rep}: ours {:.0} tok/s, {:.1} ms/tok",
            n as f64 / p,
            d * 1e3
        );
    }
    if !agree {
        eprintln!("warning: greedy tokens of ours and stock differ");
    }

    // KV export / import.
    let (kv, _) = ours.decoder().prefill(&prompt, 0).map_err(merr)?;
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
    let mut lines = Vec::new();
    if !device.is_cpu() {
        lines.push(device_agreement(&path, &opts, &prompt, &last_tokens)?);
    }
    if !llama_prefill.is_empty() {
        let name = if device.is_cpu() {
            format!("llama.cpp llama-bench, same GGUF, {threads} threads")
        } else {
            "llama.cpp llama-bench, same GGUF, every layer on the GPU".to_string()
        };
        lines.push(
            Line::higher(
                "model.prefill_vs_llama_cpp",
                median(ours_prefill.clone()),
                median(llama_prefill),
                "tokens/s",
                &name,
            )
            .bar(1.0),
        );
        lines.push(
            Line::lower(
                "model.decode_vs_llama_cpp",
                median(ours_decode.clone()),
                median(llama_decode),
                "ms/token",
                &name,
            )
            .bar(1.0),
        );
    }
    // Host memory says nothing of a model loaded onto a GPU.
    if let (ModelSource::Gguf(_), true) = (&source, device.is_cpu()) {
        // Ratio = file / resident: at least 1/1.3 when resident memory is at most 1.3x the file.
        lines.push(
            Line::lower(
                "model.resident_memory",
                loaded_bytes as f64 / (1 << 20) as f64,
                file_bytes / (1 << 20) as f64,
                "MiB",
                "the GGUF file's size",
            )
            .bar(1.0 / 1.3),
        );
    }
    if stock.is_some() {
        let stock_name = "candle-transformers llama (same weights, f32)";
        lines.push(
            Line::higher(
                "model.prefill",
                median(ours_prefill),
                median(stock_prefill),
                "tokens/s",
                stock_name,
            )
            .bar(0.9),
        );
        lines.push(
            Line::lower(
                "model.decode",
                median(ours_decode),
                median(stock_decode),
                "ms/token",
                stock_name,
            )
            .bar(1.0),
        );
    }
    if let (Some(text), ModelSource::Gguf(_), true, false) =
        (&args.fidelity, &source, device.is_cpu(), args.dequantized)
    {
        lines.push(fidelity::line(&source, &ours, text, args.prompt_tokens)?);
    }
    lines.extend([
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
    ]);
    Ok(lines)
}

/// The device's greedy tokens checked against the CPU path on the same file, teacher-forced:
/// the CPU decoder is fed the prompt and the device's tokens, and each of its argmaxes is
/// compared with the device's next token. Percent equal (100: every step agrees).
fn device_agreement(
    path: &std::path::Path,
    opts: &LoadOptions,
    prompt: &[u32],
    tokens: &[u32],
) -> Result<Line, Error> {
    let source = ModelSource::from_path(path).map_err(merr)?;
    let cpu_opts = LoadOptions {
        device: candle_core::Device::Cpu,
        ..opts.clone()
    };
    let cpu = Model::load(&source, &cpu_opts).map_err(merr)?;
    let mut cache = cpu
        .decoder()
        .new_cache(prompt.len() + tokens.len())
        .map_err(merr)?;
    let mut logits = cpu
        .decoder()
        .forward(&mut cache, prompt, Logits::Last)
        .map_err(merr)?;
    let mut equal = 0;
    for &t in tokens {
        if model::Decoder::argmax(&logits).map_err(merr)? == t {
            equal += 1;
        }
        logits = cpu
            .decoder()
            .forward(&mut cache, &[t], Logits::Last)
            .map_err(merr)?;
    }
    let share = 100.0 * equal as f64 / tokens.len().max(1) as f64;
    eprintln!(
        "device vs CPU: {equal}/{} greedy tokens equal",
        tokens.len()
    );
    Ok(Line::higher(
        "model.device_tokens_vs_cpu",
        share,
        100.0,
        "% greedy tokens equal (teacher-forced)",
        "the CPU path on the same file",
    ))
}

/// candle-transformers' Llama on our weights, exported in HF layout (dequantized, f32).
fn load_stock(
    ours: &Model,
    device: &candle_core::Device,
) -> Result<(stock::Llama, stock::Config), Error> {
    let dir = tempfile::tempdir().map_err(crate::io("temporary directory"))?;
    ours.export_hf(dir.path()).map_err(merr)?;
    let cfg_text = std::fs::read_to_string(dir.path().join("config.json"))
        .map_err(crate::io("config.json"))?;
    let stock_cfg: stock::LlamaConfig =
        serde_json::from_str(&cfg_text).map_err(|e| Error::Check(format!("stock config: {e}")))?;
    let stock_cfg = stock_cfg.into_config(false);
    let tensors = candle_core::safetensors::load(dir.path().join("model.safetensors"), device)
        .map_err(cerr)?;
    let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, device);
    let stock_model = stock::Llama::load(vb, &stock_cfg).map_err(cerr)?;
    Ok((stock_model, stock_cfg))
}

/// One stock run: prefill seconds, decode seconds per token, greedy tokens.
fn run_stock(
    stock_model: &stock::Llama,
    stock_cfg: &stock::Config,
    device: &candle_core::Device,
    prompt: &[u32],
    decode_tokens: usize,
) -> Result<(f64, f64, Vec<u32>), Error> {
    let n = prompt.len();
    let mut scache = stock::Cache::new(true, DType::F32, stock_cfg, device).map_err(cerr)?;
    let input = Tensor::new(prompt, device)
        .and_then(|t| t.unsqueeze(0))
        .map_err(cerr)?;
    let t = Instant::now();
    let mut slogits = stock_model.forward(&input, 0, &mut scache).map_err(cerr)?;
    device.synchronize().map_err(cerr)?;
    let sp = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut stock_tokens = Vec::new();
    for i in 0..decode_tokens {
        let next = model::Decoder::argmax(&slogits.squeeze(0).map_err(cerr)?).map_err(merr)?;
        stock_tokens.push(next);
        let input = Tensor::new(&[next], device)
            .and_then(|t| t.unsqueeze(0))
            .map_err(cerr)?;
        slogits = stock_model
            .forward(&input, n + i, &mut scache)
            .map_err(cerr)?;
    }
    let sd = t.elapsed().as_secs_f64() / decode_tokens.max(1) as f64;
    Ok((sp, sd, stock_tokens))
}
