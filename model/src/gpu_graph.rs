//! A decode step as a CUDA graph: captured once per sequence cache, replayed for every later
//! token, so the step's ~15 launches per layer cost one launch from the host
//! ([`crate::decoder`]'s `decode_graphed` builds and replays it).
//!
//! A graph bakes in every kernel's arguments, so what changes from token to token lives in
//! device buffers written before each replay: the token id, the rotation's sines and cosines
//! for its position, and the cache's length (the kernels of [`crate::gpu_ops`] and the
//! attention read it from there). The logits land in a buffer of their own. The graph also
//! bakes in the cache's buffers: it is dropped when they are replaced (the cache grows).
//!
//! `RAGKV_CUDA_GRAPH=off` decodes without graphs, for comparison.

#[cfg(feature = "cuda")]
pub(crate) use cuda::{enabled, param_cache, Capture, Graph, StepGraph};

/// A decode step's CUDA graph (none without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub(crate) enum StepGraph {}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::{Arc, OnceLock};

    use candle_core::cuda_backend::cudarc::driver::sys::{
        CUgraphInstantiate_flags, CUstreamCaptureMode,
    };
    use candle_core::cuda_backend::cudarc::driver::{
        result, CudaGraph, CudaStream, DevicePtr, DeviceRepr,
    };
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{DType, Device, Storage, Tensor};

    /// Whether decode steps are replayed as graphs (`RAGKV_CUDA_GRAPH` unset or not `off`).
    pub(crate) fn enabled() -> bool {
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| std::env::var("RAGKV_CUDA_GRAPH").as_deref() != Ok("off"))
    }

    /// Copies `vals` into the (contiguous) device tensor `t`'s first elements, on this
    /// thread's stream.
    fn write<T: CudaDType + DeviceRepr>(t: &Tensor, vals: &[T]) -> candle_core::Result<()> {
        let (s, l) = t.storage_and_layout();
        let Storage::Cuda(c) = &*s else {
            candle_core::bail!("not a CUDA tensor");
        };
        if t.elem_count() < vals.len() || !l.is_contiguous() {
            candle_core::bail!("{} values into {:?}", vals.len(), t.shape());
        }
        let Device::Cuda(dev) = t.device() else {
            candle_core::bail!("not a CUDA tensor");
        };
        let slice = c.as_cuda_slice::<T>()?;
        let view = slice.slice(l.start_offset()..);
        let stream = dev.cuda_stream();
        let (ptr, _sync) = view.device_ptr(&stream);
        // SAFETY: `ptr` holds at least `vals.len()` elements of `T` (checked above); the copy
        // is queued on this thread's stream, ordered before the replay that reads it, and
        // the pageable source is staged by the driver before the call returns.
        unsafe { result::memcpy_htod_async(ptr, vals, stream.cu_stream()) }
            .map_err(candle_core::Error::wrap)
    }

    /// A stream capture in progress on this thread's stream (relaxed mode: other threads
    /// may go on with their own work), with candle's cache of small host-to-device parameter
    /// uploads on (a capture cannot upload; the eager run before it filled the cache).
    pub(crate) struct Capture {
        stream: Arc<CudaStream>,
        /// candle's parameter-cache guard (its type is not exported).
        _params: Box<dyn std::any::Any>,
    }

    impl Capture {
        /// Starts capturing `device`'s work queued from this thread.
        pub(crate) fn begin(device: &Device) -> candle_core::Result<Capture> {
            let Device::Cuda(dev) = device else {
                candle_core::bail!("graph capture needs a CUDA device");
            };
            let stream = dev.cuda_stream();
            let params = dev.enable_cuda_graph_htod_cache();
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(candle_core::Error::wrap)?;
            Ok(Capture {
                stream,
                _params: Box::new(params),
            })
        }

        /// Ends the capture: the instantiated graph, or the error that broke the capture.
        pub(crate) fn end(self) -> candle_core::Result<Graph> {
            let graph = self
                .stream
                .end_capture(CUgraphInstantiate_flags(0))
                .map_err(candle_core::Error::wrap)?;
            graph
                .map(Graph)
                .ok_or_else(|| candle_core::Error::Msg("the capture recorded nothing".into()))
        }
    }

    /// Candle's parameter-upload cache on, for the eager run that precedes a capture.
    pub(crate) fn param_cache(device: &Device) -> Option<Box<dyn std::any::Any>> {
        match device {
            Device::Cuda(dev) => Some(Box::new(dev.enable_cuda_graph_htod_cache())),
            _ => None,
        }
    }

    /// An instantiated graph.
    pub(crate) struct Graph(CudaGraph);

    // SAFETY: a graph's handles may be launched from any thread with the context current
    // (cudarc binds it on launch); the decoder launches it from the thread that owns the
    // sequence's cache, one launch at a time (`&mut KvCache`).
    unsafe impl Send for Graph {}

    /// A decode step captured over one cache: its input buffers, its output, and what it
    /// was captured for.
    pub(crate) struct StepGraph {
        /// `None` once capturing failed for this cache: it decodes eagerly.
        pub graph: Option<Graph>,
        /// The token id `(1,)` u32.
        pub ids: Tensor,
        /// The rotation's cos and sin for the token's position `(1, head_dim / 2)`.
        pub cos: Tensor,
        pub sin: Tensor,
        /// The cache's rows before the token `(1,)` i32.
        pub past: Tensor,
        /// The logits `(1, vocab)` f32.
        pub out: Tensor,
        /// The cache's capacity and the decoder's address when captured.
        pub capacity: usize,
        pub owner: usize,
    }

    impl std::fmt::Debug for StepGraph {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("StepGraph")
                .field("captured", &self.graph.is_some())
                .field("capacity", &self.capacity)
                .finish()
        }
    }

    impl StepGraph {
        /// Buffers for a step of a model with heads of `head_dim` and `vocab` logits.
        pub(crate) fn new(
            device: &Device,
            head_dim: usize,
            vocab: usize,
            capacity: usize,
            owner: usize,
        ) -> candle_core::Result<StepGraph> {
            Ok(StepGraph {
                graph: None,
                ids: Tensor::zeros(1, DType::U32, device)?,
                cos: Tensor::zeros((1, head_dim / 2), DType::F32, device)?,
                sin: Tensor::zeros((1, head_dim / 2), DType::F32, device)?,
                past: Tensor::zeros(1, DType::I32, device)?,
                out: Tensor::zeros((1, vocab), DType::F32, device)?,
                capacity,
                owner,
            })
        }

        /// Writes the step's inputs: token `id` at row `past` with the rotation `cos`, `sin`.
        pub(crate) fn set(
            &self,
            id: u32,
            past: usize,
            cos: &[f32],
            sin: &[f32],
        ) -> candle_core::Result<()> {
            write(&self.ids, &[id])?;
            write(&self.past, &[past as i32])?;
            write(&self.cos, cos)?;
            write(&self.sin, sin)
        }

        /// Replays the captured step (after [`StepGraph::set`]).
        pub(crate) fn launch(&self) -> candle_core::Result<()> {
            match &self.graph {
                Some(g) => g.0.launch().map_err(candle_core::Error::wrap),
                None => candle_core::bail!("no graph captured"),
            }
        }
    }
}
