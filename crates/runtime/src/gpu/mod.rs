//! The GPU context: one wgpu device and queue, the adapter they came from, a pipeline
//! cache keyed by shader and constants, a buffer pool, device-memory accounting, and
//! the one read-back helper.
//!
//! Everything GPU in the workspace goes through a [`GpuContext`]: the wgpu backend of
//! this crate ([`crate::backend::WgpuBackend`]) and any lever crate that brings its own
//! WGSL. Every buffer is made by [`GpuContext::buffer`] or [`GpuContext::weight_buffer`]
//! and counted in [`GpuContext::memory`] until it is destroyed (pooled buffers stay
//! counted: they are still held on the device).
//!
//! ```no_run
//! use ballast_runtime::gpu::{DeviceChoice, GpuContext};
//! # fn main() -> Result<(), ballast_runtime::Error> {
//! match GpuContext::choose(DeviceChoice::Auto, &mut |line| eprintln!("{line}"))? {
//!     Some(gpu) => println!("computing on {}", gpu.adapter()),
//!     None => println!("computing on the CPU"),
//! }
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// Which device computes: `--device cpu|gpu|auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// The native CPU backend.
    #[default]
    Cpu,
    /// The best GPU adapter (a real one before a software one); an error if none.
    Gpu,
    /// A real GPU, else a software one, else the CPU backend (saying so).
    Auto,
}

impl FromStr for DeviceChoice {
    type Err = Error;

    fn from_str(s: &str) -> Result<DeviceChoice> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceChoice::Cpu),
            "gpu" | "wgpu" => Ok(DeviceChoice::Gpu),
            "auto" => Ok(DeviceChoice::Auto),
            other => Err(Error::InvalidArgument {
                what: format!("unknown device {other:?} (expected cpu, gpu or auto)"),
            }),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Gpu => "gpu",
            DeviceChoice::Auto => "auto",
        })
    }
}

/// What a user needs to know about the adapter in use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterSummary {
    /// The adapter's name (`llvmpipe (LLVM 15.0.6, 256 bits)` for lavapipe).
    pub name: String,
    /// The graphics API (`Vulkan`, `Metal`, `Dx12`).
    pub backend: String,
    /// Discrete, integrated, virtual, software (`Cpu`) or other.
    pub device_type: String,
    /// Driver name and version, where the adapter reports them.
    pub driver: String,
}

impl AdapterSummary {
    fn of(info: &wgpu::AdapterInfo) -> AdapterSummary {
        let driver = [info.driver.as_str(), info.driver_info.as_str()]
            .iter()
            .filter(|s| !s.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" ");
        AdapterSummary {
            name: info.name.clone(),
            backend: format!("{:?}", info.backend),
            device_type: format!("{:?}", info.device_type),
            driver,
        }
    }

    /// True for a software rasterizer (lavapipe, SwiftShader, WARP).
    pub fn is_software(&self) -> bool {
        self.device_type == "Cpu"
    }
}

impl fmt::Display for AdapterSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}, {}", self.name, self.backend, self.device_type)?;
        if !self.driver.is_empty() {
            write!(f, ", {}", self.driver)?;
        }
        f.write_str(")")
    }
}

/// Bytes held on the device: now, and the most at any moment.
#[derive(Debug, Default)]
pub struct MemoryCount {
    current: AtomicU64,
    peak: AtomicU64,
}

impl MemoryCount {
    fn add(&self, bytes: u64) {
        let now = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn sub(&self, bytes: u64) {
        self.current.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Bytes held now.
    pub fn current(&self) -> u64 {
        self.current.load(Ordering::Relaxed)
    }

    /// Most bytes held at once since the context was made (or [`MemoryCount::reset_peak`]).
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Sets the peak back to what is held now.
    pub fn reset_peak(&self) {
        self.peak.store(self.current(), Ordering::Relaxed);
    }
}

/// A device buffer, counted in [`MemoryCount`] while it exists. Buffers from the pool
/// return to it when dropped (and stay counted); weight buffers are destroyed.
pub struct GpuBuffer {
    buffer: Option<wgpu::Buffer>,
    size: u64,
    pool: Option<Arc<BufferPool>>,
    memory: Arc<MemoryCount>,
}

impl GpuBuffer {
    /// The wgpu buffer.
    pub fn raw(&self) -> &wgpu::Buffer {
        self.buffer.as_ref().expect("buffer present until drop")
    }

    /// Its size in bytes (pooled buffers may be larger than asked for).
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        let Some(buffer) = self.buffer.take() else {
            return;
        };
        match &self.pool {
            Some(pool) => pool.give_back(buffer, self.size),
            None => {
                buffer.destroy();
                self.memory.sub(self.size);
            }
        }
    }
}

/// Free pooled buffers by size class (storage buffers that may be copied to and from).
#[derive(Default)]
pub struct BufferPool {
    free: Mutex<HashMap<u64, Vec<wgpu::Buffer>>>,
}

impl BufferPool {
    fn give_back(&self, buffer: wgpu::Buffer, size: u64) {
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(size)
            .or_default()
            .push(buffer);
    }

    fn take(&self, size: u64) -> Option<wgpu::Buffer> {
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&size)
            .and_then(Vec::pop)
    }
}

/// A WGSL shader: a name (the cache key), its source, and whether wgpu compiles it with
/// its runtime checks.
#[derive(Clone, Copy, Debug)]
pub struct Shader {
    /// Unique name, e.g. `"ballast.matmul"`.
    pub name: &'static str,
    /// WGSL source.
    pub source: &'static str,
    /// Compiled without wgpu's runtime checks ([`Shader::trusted`]).
    trusted: bool,
}

impl Shader {
    /// A shader wgpu compiles with its runtime checks: every dynamic index into an
    /// array clamped, every loop bounded by a counter. For WGSL that parses untrusted
    /// data, or that nobody audited.
    pub const fn checked(name: &'static str, source: &'static str) -> Shader {
        Shader {
            name,
            source,
            trusted: false,
        }
    }

    /// A shader wgpu compiles without those checks (`BALLAST_WGPU_CHECKED` set at run
    /// time puts them back, to tell a kernel's bug from the driver's). They are ALU
    /// work in the weight products' inner loops: SmolLM2's decode on lavapipe went from
    /// 2.48-2.58 to 2.79-2.80 tokens/s without them.
    ///
    /// # Safety
    /// For every input the host lets through: every index into a local or workgroup
    /// array stays below its length, every loop ends, and every buffer index stays
    /// within the bound buffer (on Vulkan the device's robust buffer access, which wgpu
    /// enables where it exists, still guards the buffers; elsewhere nothing does).
    pub const unsafe fn trusted(name: &'static str, source: &'static str) -> Shader {
        Shader {
            name,
            source,
            trusted: true,
        }
    }
}

type PipelineKey = (&'static str, &'static str, Vec<(&'static str, u64)>);

/// What a bind group binds: the pipeline, the parameter buffer and the offset of the
/// dispatch's slot in it, and the buffers in binding order. wgpu compares these handles
/// by identity, and the key holds them, so no other buffer can take their place.
type BindKey = (wgpu::ComputePipeline, wgpu::Buffer, u64, Vec<wgpu::Buffer>);

/// Bind groups kept at most; past it the cache starts again (a decode pass makes a few
/// hundred, the same ones every token).
const MAX_BIND_GROUPS: usize = 8192;

/// The device, its queue and what the backend keeps around them.
pub struct GpuContext {
    device: wgpu::Device,
    queue: wgpu::Queue,
    adapter: AdapterSummary,
    limits: wgpu::Limits,
    timestamps: bool,
    pipelines: Mutex<HashMap<PipelineKey, Arc<wgpu::ComputePipeline>>>,
    modules: Mutex<HashMap<&'static str, wgpu::ShaderModule>>,
    /// Bind groups by what they bind: a decode pass over a backend's pass buffers binds
    /// the same weights, activations and parameter slots every token, so its bind groups
    /// are made once.
    bind_groups: Mutex<HashMap<BindKey, wgpu::BindGroup>>,
    /// Bind groups made so far (not found in the cache).
    bind_groups_made: AtomicU64,
    pool: Arc<BufferPool>,
    memory: Arc<MemoryCount>,
    /// The first error the device reported since it was last checked.
    device_error: Arc<Mutex<Option<String>>>,
    /// Fill every scratch buffer with NaN bits when handed out (tests).
    poison: std::sync::atomic::AtomicBool,
}

/// Storage, uniform and copy usages every pooled buffer has, so any of them can be bound, filled
/// with `write_buffer` and copied into a read-back.
const POOL_USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::UNIFORM)
    .union(wgpu::BufferUsages::COPY_DST)
    .union(wgpu::BufferUsages::COPY_SRC);

fn rank(info: &wgpu::AdapterInfo) -> u32 {
    match info.device_type {
        wgpu::DeviceType::DiscreteGpu => 4,
        wgpu::DeviceType::IntegratedGpu => 3,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 1,
        wgpu::DeviceType::Cpu => 0,
    }
}

impl GpuContext {
    /// Every adapter wgpu sees on this machine (for `ballast devices` and diagnostics).
    pub fn adapters() -> Vec<AdapterSummary> {
        let instance = instance();
        pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()))
            .iter()
            .map(|a| AdapterSummary::of(&a.get_info()))
            .collect()
    }

    /// Opens the device `choice` asks for: `Ok(None)` means the CPU backend (asked for, or
    /// `auto` found no usable adapter, which `note` is told).
    pub fn choose(
        choice: DeviceChoice,
        note: &mut dyn FnMut(&str),
    ) -> Result<Option<Arc<GpuContext>>> {
        match choice {
            DeviceChoice::Cpu => Ok(None),
            DeviceChoice::Gpu => GpuContext::new().map(Some),
            DeviceChoice::Auto => match GpuContext::new() {
                Ok(ctx) => Ok(Some(ctx)),
                Err(e) => {
                    note(&format!("--device auto: {e}; using the CPU backend"));
                    Ok(None)
                }
            },
        }
    }

    /// The best adapter (discrete, integrated, virtual, other, then software), with the
    /// limits the backend needs raised to what that adapter offers.
    pub fn new() -> Result<Arc<GpuContext>> {
        let instance = instance();
        let mut adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        if adapters.is_empty() {
            return Err(Error::NoGpuAdapter {
                why: "wgpu found none (on Linux, install a Vulkan driver; Debian: \
                      apt-get install mesa-vulkan-drivers)"
                    .into(),
            });
        }
        adapters.sort_by_key(|a| std::cmp::Reverse(rank(&a.get_info())));
        let mut errors = Vec::new();
        for adapter in adapters {
            match GpuContext::open(&adapter) {
                Ok(ctx) => return Ok(Arc::new(ctx)),
                Err(e) => errors.push(e.to_string()),
            }
        }
        Err(Error::NoGpuAdapter {
            why: errors.join("; "),
        })
    }

    fn open(adapter: &wgpu::Adapter) -> Result<GpuContext> {
        let info = adapter.get_info();
        let summary = AdapterSummary::of(&info);
        let offered = adapter.limits();
        // Large models need large storage buffers and big dispatches: ask for all the
        // adapter offers of those, and the WebGPU defaults for the rest.
        let mut limits = wgpu::Limits::downlevel_defaults();
        limits.max_storage_buffer_binding_size = offered.max_storage_buffer_binding_size;
        limits.max_buffer_size = offered.max_buffer_size;
        limits.max_storage_buffers_per_shader_stage =
            offered.max_storage_buffers_per_shader_stage.min(16);
        limits.max_compute_workgroups_per_dimension = offered.max_compute_workgroups_per_dimension;
        limits.max_compute_invocations_per_workgroup =
            offered.max_compute_invocations_per_workgroup.min(256);
        limits.max_compute_workgroup_size_x = offered.max_compute_workgroup_size_x.min(256);
        limits.max_compute_workgroup_storage_size = offered.max_compute_workgroup_storage_size;
        const NEED_STORAGE: u32 = 8;
        if limits.max_storage_buffers_per_shader_stage < NEED_STORAGE
            || limits.max_compute_invocations_per_workgroup < 256
        {
            return Err(Error::GpuDevice {
                adapter: summary.to_string(),
                why: format!(
                    "offers {} storage buffers per stage and {} invocations per workgroup; \
                     the backend needs {NEED_STORAGE} and 256",
                    limits.max_storage_buffers_per_shader_stage,
                    limits.max_compute_invocations_per_workgroup
                ),
            });
        }
        let timestamps = adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
        let features = if timestamps {
            wgpu::Features::TIMESTAMP_QUERY
        } else {
            wgpu::Features::empty()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("ballast"),
            required_features: features,
            required_limits: limits.clone(),
            memory_hints: wgpu::MemoryHints::Performance,
            ..Default::default()
        }))
        .map_err(|e| Error::GpuDevice {
            adapter: summary.to_string(),
            why: format!("request_device failed: {e}"),
        })?;
        let device_error = Arc::new(Mutex::new(None::<String>));
        let sink = device_error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = sink.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(e.to_string());
            }
        }));
        Ok(GpuContext {
            device,
            queue,
            adapter: summary,
            limits,
            timestamps,
            pipelines: Mutex::default(),
            modules: Mutex::default(),
            bind_groups: Mutex::default(),
            bind_groups_made: AtomicU64::new(0),
            pool: Arc::default(),
            memory: Arc::default(),
            device_error,
            poison: Default::default(),
        })
    }

    /// The wgpu device.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The wgpu queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// Which adapter this is.
    pub fn adapter(&self) -> &AdapterSummary {
        &self.adapter
    }

    /// The limits the device was opened with.
    pub fn limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    /// True if the device can time passes with timestamp queries.
    pub fn has_timestamps(&self) -> bool {
        self.timestamps
    }

    /// Nanoseconds per timestamp tick.
    pub fn timestamp_period(&self) -> f32 {
        self.queue.get_timestamp_period()
    }

    /// Bytes held on the device.
    pub fn memory(&self) -> &MemoryCount {
        &self.memory
    }

    /// Largest storage buffer one binding may see.
    pub fn max_binding_bytes(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
    }

    /// Returns the first error the device reported since the last call, as [`Error::Gpu`].
    pub fn check(&self) -> Result<()> {
        match self
            .device_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            Some(what) => Err(Error::Gpu { what }),
            None => Ok(()),
        }
    }

    /// The bind group of a dispatch of `pipeline`: binding 0 is `params_size` bytes of
    /// `params` at `offset`, bindings 1.. are `buffers` whole. Made once per distinct set
    /// and reused after.
    pub fn bind_group(
        &self,
        pipeline: &wgpu::ComputePipeline,
        params: &wgpu::Buffer,
        offset: u64,
        params_size: u64,
        buffers: &[&wgpu::Buffer],
        label: &str,
    ) -> wgpu::BindGroup {
        let key: BindKey = (
            pipeline.clone(),
            params.clone(),
            offset,
            buffers.iter().map(|b| (*b).clone()).collect(),
        );
        let mut cache = self.bind_groups.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(g) = cache.get(&key) {
            return g.clone();
        }
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: params,
                offset,
                size: std::num::NonZeroU64::new(params_size),
            }),
        }];
        for (i, b) in buffers.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: b.as_entire_binding(),
            });
        }
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(label),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        self.bind_groups_made.fetch_add(1, Ordering::Relaxed);
        if cache.len() >= MAX_BIND_GROUPS {
            cache.clear();
        }
        cache.insert(key, group.clone());
        group
    }

    /// Bind groups made so far: a pass that binds what an earlier one bound makes none.
    pub fn bind_groups_made(&self) -> u64 {
        self.bind_groups_made.load(Ordering::Relaxed)
    }

    /// Fills `buffer` with NaN bits if scratch poisoning is on ([`GpuContext::set_poison`]):
    /// for buffers handed out again without going through [`GpuContext::buffer`].
    pub fn poison_if_on(&self, buffer: &GpuBuffer) {
        if self.poison.load(Ordering::Relaxed) {
            self.queue
                .write_buffer(buffer.raw(), 0, &vec![0xff; buffer.size() as usize]);
        }
    }

    /// The compute pipeline of `entry` in `shader` with the overridable `constants`,
    /// compiled once per distinct key.
    pub fn pipeline(
        &self,
        shader: &Shader,
        entry: &'static str,
        constants: &[(&'static str, f64)],
    ) -> Arc<wgpu::ComputePipeline> {
        let key: PipelineKey = (
            shader.name,
            entry,
            constants.iter().map(|(n, v)| (*n, v.to_bits())).collect(),
        );
        let mut cache = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = cache.get(&key) {
            return p.clone();
        }
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        let module = modules.entry(shader.name).or_insert_with(|| {
            let desc = wgpu::ShaderModuleDescriptor {
                label: Some(shader.name),
                source: wgpu::ShaderSource::Wgsl(shader.source.into()),
            };
            if shader.trusted && std::env::var_os("BALLAST_WGPU_CHECKED").is_none() {
                // SAFETY: `Shader::trusted`'s contract, which whoever built the shader
                // took on.
                unsafe {
                    self.device
                        .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
                }
            } else {
                self.device.create_shader_module(desc)
            }
        });
        let pipeline = Arc::new(self.device.create_compute_pipeline(
            &wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module,
                entry_point: Some(entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants,
                    ..Default::default()
                },
                cache: None,
            },
        ));
        cache.insert(key, pipeline.clone());
        pipeline
    }

    /// With `on`, every scratch buffer [`GpuContext::buffer`] hands out is first filled
    /// with NaN bits, so a kernel that leaves an output element unwritten is caught.
    pub fn set_poison(&self, on: bool) {
        self.poison.store(on, Ordering::Relaxed);
    }

    /// A scratch storage buffer of at least `bytes` (from the pool when one is free).
    pub fn buffer(&self, bytes: u64, label: &str) -> Result<GpuBuffer> {
        // Size classes: powers of two from 256 bytes, so buffers are reused across
        // passes of different lengths.
        let size = bytes.max(256).next_power_of_two();
        if size > self.limits.max_buffer_size {
            return Err(Error::GpuLimit {
                what: label.to_string(),
                needed: bytes,
                limit: self.limits.max_buffer_size,
            });
        }
        let buffer = match self.pool.take(size) {
            Some(b) => b,
            None => {
                let b = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size,
                    usage: POOL_USAGE,
                    mapped_at_creation: false,
                });
                self.memory.add(size);
                b
            }
        };
        if self.poison.load(Ordering::Relaxed) {
            self.queue
                .write_buffer(&buffer, 0, &vec![0xff; size as usize]);
        }
        Ok(GpuBuffer {
            buffer: Some(buffer),
            size,
            pool: Some(self.pool.clone()),
            memory: self.memory.clone(),
        })
    }

    /// An unpooled buffer of `bytes` with `usage` (query resolution, say), counted
    /// until dropped.
    pub fn buffer_with_usage(
        &self,
        bytes: u64,
        usage: wgpu::BufferUsages,
        label: &str,
    ) -> Result<GpuBuffer> {
        let size = bytes.div_ceil(4).max(1) * 4;
        if size > self.limits.max_buffer_size {
            return Err(Error::GpuLimit {
                what: label.to_string(),
                needed: size,
                limit: self.limits.max_buffer_size,
            });
        }
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage,
            mapped_at_creation: false,
        });
        self.memory.add(size);
        Ok(GpuBuffer {
            buffer: Some(buffer),
            size,
            pool: None,
            memory: self.memory.clone(),
        })
    }

    /// A buffer holding exactly `bytes` (padded to 4), for weights: not pooled,
    /// destroyed (and uncounted) when dropped.
    pub fn weight_buffer(&self, bytes: &[u8], label: &str) -> Result<GpuBuffer> {
        let size = (bytes.len() as u64).div_ceil(4).max(1) * 4;
        if size > self.max_binding_bytes() {
            return Err(Error::GpuLimit {
                what: label.to_string(),
                needed: size,
                limit: self.max_binding_bytes(),
            });
        }
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: true,
        });
        match buffer.slice(..).get_mapped_range_mut() {
            Ok(mut view) => {
                if bytes.len() as u64 == size {
                    view.copy_from_slice(bytes);
                } else {
                    let mut padded = bytes.to_vec();
                    padded.resize(size as usize, 0);
                    view.copy_from_slice(&padded);
                }
            }
            Err(e) => {
                buffer.destroy();
                return Err(Error::Gpu {
                    what: format!("mapping {label} for upload: {e}"),
                });
            }
        }
        buffer.unmap();
        self.memory.add(size);
        Ok(GpuBuffer {
            buffer: Some(buffer),
            size,
            pool: None,
            memory: self.memory.clone(),
        })
    }

    /// Submits `encoder` after copying each `(buffer, offset, bytes)` source into one
    /// staging buffer, waits, and returns the bytes in order: the one read-back of a
    /// pass. Device errors raised by the submission come back as [`Error::Gpu`].
    pub fn submit_and_read(
        &self,
        mut encoder: wgpu::CommandEncoder,
        sources: &[(&wgpu::Buffer, u64, u64)],
    ) -> Result<Vec<u8>> {
        let total: u64 = sources.iter().map(|s| s.2).sum();
        let staging_size = total.div_ceil(4).max(1) * 4;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("ballast read-back"),
            size: staging_size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.memory.add(staging_size);
        let result = (|| {
            let mut at = 0;
            for &(buffer, offset, bytes) in sources {
                encoder.copy_buffer_to_buffer(buffer, offset, &staging, at, bytes);
                at += bytes;
            }
            self.queue.submit([encoder.finish()]);
            self.check()?;
            let slice = staging.slice(..);
            let (tx, rx) = std::sync::mpsc::channel();
            slice.map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
            self.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| Error::Gpu {
                    what: format!("waiting for the device: {e}"),
                })?;
            match rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    return Err(Error::Gpu {
                        what: format!("mapping the read-back buffer: {e}"),
                    })
                }
                Err(_) => {
                    return Err(Error::Gpu {
                        what: "the read-back never completed".into(),
                    })
                }
            }
            self.check()?;
            let out = slice.get_mapped_range().map_err(|e| Error::Gpu {
                what: format!("reading the read-back buffer: {e}"),
            })?[..total as usize]
                .to_vec();
            staging.unmap();
            Ok(out)
        })();
        staging.destroy();
        self.memory.sub(staging_size);
        result
    }
}

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    // Validation layers are for wgpu's developers; they slow lavapipe down a lot.
    desc.flags = wgpu::InstanceFlags::empty().with_env();
    wgpu::Instance::new(desc)
}
