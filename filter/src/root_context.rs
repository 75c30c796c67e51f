//! The proxy-wasm adapter of the per-VM root context: reads the configurations, defines the
//! metrics, and forwards configuration, ticks and tokenizer answers to [`Plugin`].

use std::rc::Rc;
use std::sync::Arc;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

use crate::host::{self, Buffer};
use crate::http_context::{call_reply, KvRouteHttp, VmState, WasmHost};
use crate::metrics::{MetricIds, MetricKind};
use crate::plugin::Plugin;
use crate::seam::{CallId, Level};
use crate::tick_plan::TickPeriod;

/// Name of the gauge holding a VM's linear memory size (bytes). Every VM sets the same gauge, so
/// it shows the last reporting VM (they are alike: one tokenizer per model each).
const VM_MEMORY_GAUGE: &str = "kvroute.vm_memory_bytes";

/// The root context.
pub struct KvRouteRoot {
    vm: Rc<VmState>,
    vm_config: Vec<u8>,
    vm_memory_gauge: Option<u32>,
    /// The root's tick period (busy or idle, [`crate::tick_plan`]), shared with the plugin's
    /// waker.
    tick: Arc<TickPeriod>,
}

impl KvRouteRoot {
    /// A root context with no configuration yet.
    pub fn new(id: u32) -> Self {
        Self {
            vm: Rc::new(VmState {
                root_id: id,
                ..VmState::default()
            }),
            vm_config: Vec::new(),
            vm_memory_gauge: None,
            tick: Arc::new(TickPeriod::default()),
        }
    }

    /// Sets the tick period the plugin's pending work asks for, if it changed.
    fn replan_tick(&self, plugin: &Plugin) {
        let Some(period) = self
            .tick
            .replanned(host::now_millis(), plugin.next_tick_ms())
        else {
            return;
        };
        if let Err(e) = set_tick_period(&self.tick, period) {
            self.log(
                Level::Warn,
                &format!(
                    "kvroute: cannot set the tick period ({e}); tokenizer fetches will not be retried"
                ),
            );
        }
    }

    fn log(&self, level: Level, message: &str) {
        host::log(level, message);
    }
}

/// Sets the root's tick period and records it in `tick` once the host took it.
fn set_tick_period(tick: &TickPeriod, period: std::time::Duration) -> host::HostResult<()> {
    host::set_tick_period(period)?;
    tick.set(period);
    Ok(())
}

/// The VM's linear memory in bytes (0 off wasm).
pub fn vm_memory_bytes() -> u64 {
    #[cfg(target_arch = "wasm32")]
    {
        (core::arch::wasm32::memory_size::<0>() as u64) * 65_536
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        0
    }
}

impl Context for KvRouteRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(plugin) = &self.vm.plugin else {
            return;
        };
        let reply = call_reply(num_headers, body_size);
        // Other tokens are reports (`/v1/complete`, agreement) issued on the root's behalf: nothing
        // to do.
        plugin.on_call_reply(
            &mut WasmHost::new(&self.vm, self.vm.root_id),
            CallId(u64::from(token_id)),
            &reply,
        );
    }
}

impl RootContext for KvRouteRoot {
    fn on_vm_start(&mut self, vm_configuration_size: usize) -> bool {
        if vm_configuration_size > 0 {
            match host::get_buffer(Buffer::VmConfiguration, 0, vm_configuration_size) {
                Ok(b) => self.vm_config = b,
                Err(e) => self.log(
                    Level::Warn,
                    &format!("kvroute: cannot read the VM configuration: {e}"),
                ),
            }
        }
        true
    }

    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let raw = if plugin_configuration_size == 0 {
            Vec::new()
        } else {
            match host::get_buffer(Buffer::PluginConfiguration, 0, plugin_configuration_size) {
                Ok(b) => b,
                Err(e) => {
                    self.log(
                        Level::Error,
                        &format!("kvroute: cannot read the plugin configuration: {e}"),
                    );
                    return false;
                }
            }
        };
        let (metrics, mut failed) = MetricIds::define(|kind, name| {
            let kind = match kind {
                MetricKind::Counter => host::MetricKind::Counter,
                MetricKind::Histogram => host::MetricKind::Histogram,
            };
            host::define_metric(kind, name).ok()
        });
        self.vm_memory_gauge = host::define_metric(host::MetricKind::Gauge, VM_MEMORY_GAUGE).ok();
        if self.vm_memory_gauge.is_none() {
            failed.push(VM_MEMORY_GAUGE);
        }
        if !failed.is_empty() {
            self.log(
                Level::Warn,
                &format!("kvroute: metrics not defined: {}", failed.join(", ")),
            );
        }
        let mut vm = VmState {
            plugin: None,
            metrics,
            root_id: self.vm.root_id,
        };
        let plugin = match Plugin::configure(&WasmHost::new(&vm, vm.root_id), &raw, &self.vm_config)
        {
            Ok(p) => Arc::new(p),
            Err(e) => {
                self.log(Level::Error, &format!("kvroute: {e}"));
                return false;
            }
        };
        vm.plugin = Some(Arc::clone(&plugin));
        self.vm = Rc::new(vm);
        // Streams add work (a held report) from their own callbacks; the host applies a tick
        // period set there to this root.
        let tick = Arc::clone(&self.tick);
        plugin.set_tick_waker(Box::new(move |due_ms| {
            if let Some(period) = tick.hastened(host::now_millis(), due_ms) {
                // A failure is logged by the next tick's re-plan, which tries again.
                let _ = set_tick_period(&tick, period);
            }
        }));
        plugin.on_tick(&mut WasmHost::new(&self.vm, self.vm.root_id));
        self.replan_tick(&plugin);
        true
    }

    fn on_tick(&mut self) {
        if let Some(plugin) = &self.vm.plugin {
            plugin.on_tick(&mut WasmHost::new(&self.vm, self.vm.root_id));
            self.replan_tick(plugin);
        }
        if let Some(id) = self.vm_memory_gauge {
            let _ = host::record_metric(id, vm_memory_bytes());
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(KvRouteHttp::new(context_id, Rc::clone(&self.vm))))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
