//! Where a model runs and which engine runs it: `--device cpu|cuda[:N]` and
//! `--engine native|candle`, parsed once into enums so an invalid mix cannot be built.
//!
//! - `native` is the bit-exact CPU engine ([`crate::Model`]); it runs on `cpu` only.
//! - `candle` is the device-generic engine ([`crate::candle_engine`]): candle's CPU device
//!   here and in CI, CUDA on GPU nodes (builds with the `cuda` feature).
//!
//! [`EngineChoice::resolve`] picks the default engine of a device (`native` on `cpu`,
//! `candle` on `cuda`) and refuses `native` on `cuda` naming both values.

use std::fmt;
use std::str::FromStr;

use crate::error::{EngineError, Result};

/// A compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// CUDA device ordinal.
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceSpec::Cuda(n)),
                _ => Err(format!("`{s}` is not a device (cpu, cuda or cuda:N)")),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    /// candle's device for this spec. CUDA needs a build with the `cuda` feature and a
    /// driver; without either the error says which is missing (never a panic).
    pub fn candle_device(self) -> Result<candle_core::Device> {
        match self {
            DeviceSpec::Cpu => Ok(candle_core::Device::Cpu),
            DeviceSpec::Cuda(n) => {
                if !candle_core::utils::cuda_is_available() {
                    return Err(EngineError::Device(format!(
                        "device cuda:{n}: this duet was built without CUDA (`make build-cuda` \
                         builds one; see docs/gpu.md)"
                    )));
                }
                candle_core::Device::new_cuda(n).map_err(|e| {
                    // candle appends a backtrace when RUST_BACKTRACE is set: keep the cause.
                    let e = e.to_string();
                    let cause = e.lines().next().unwrap_or_default();
                    EngineError::Device(format!(
                        "device cuda:{n}: {cause} (a CUDA driver, libcuda.so.1, and a GPU with \
                         this ordinal are needed)"
                    ))
                })
            }
        }
    }
}

/// Which engine runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// duet's bit-exact CPU engine.
    Native,
    /// The device-generic engine on candle.
    Candle,
}

impl FromStr for EngineKind {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "native" => Ok(EngineKind::Native),
            "candle" => Ok(EngineKind::Candle),
            _ => Err(format!("`{s}` is not an engine (native or candle)")),
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineKind::Native => "native",
            EngineKind::Candle => "candle",
        })
    }
}

/// A device and the engine asked for it (`None`: the device's default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineChoice {
    pub device: DeviceSpec,
    pub engine: Option<EngineKind>,
}

impl EngineChoice {
    /// The engine that runs: `native` on `cpu` and `candle` on `cuda` unless asked
    /// otherwise; `native` on a GPU is refused.
    pub fn resolve(self) -> Result<EngineKind> {
        match (self.device, self.engine) {
            (DeviceSpec::Cpu, None) => Ok(EngineKind::Native),
            (DeviceSpec::Cuda(_), None) => Ok(EngineKind::Candle),
            (DeviceSpec::Cuda(n), Some(EngineKind::Native)) => Err(EngineError::Device(format!(
                "engine native runs on cpu only; device cuda:{n} needs engine candle"
            ))),
            (_, Some(e)) => Ok(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print_back() {
        for (s, d) in [
            ("cpu", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda(0)),
            ("cuda:3", DeviceSpec::Cuda(3)),
        ] {
            assert_eq!(s.parse::<DeviceSpec>().unwrap(), d);
        }
        assert_eq!(DeviceSpec::Cuda(0).to_string(), "cuda:0");
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", ""] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(e.contains(&format!("`{bad}`")), "{e}");
        }
    }

    #[test]
    fn each_device_has_its_default_engine_and_native_stays_on_the_cpu() {
        let c = |device, engine| EngineChoice { device, engine };
        assert_eq!(
            c(DeviceSpec::Cpu, None).resolve().unwrap(),
            EngineKind::Native
        );
        assert_eq!(
            c(DeviceSpec::Cpu, Some(EngineKind::Candle))
                .resolve()
                .unwrap(),
            EngineKind::Candle
        );
        assert_eq!(
            c(DeviceSpec::Cuda(1), None).resolve().unwrap(),
            EngineKind::Candle
        );
        let e = c(DeviceSpec::Cuda(1), Some(EngineKind::Native))
            .resolve()
            .unwrap_err();
        assert!(e.to_string().contains("cuda:1"), "{e}");
    }

    #[test]
    fn cuda_without_the_feature_or_a_driver_is_refused_with_the_reason() {
        match DeviceSpec::Cuda(0).candle_device() {
            Err(e) if !candle_core::utils::cuda_is_available() => {
                assert!(e.to_string().contains("without CUDA"), "{e}")
            }
            Err(e) => assert!(e.to_string().contains("libcuda.so.1"), "{e}"),
            Ok(d) => assert!(d.is_cuda(), "a CUDA build on a GPU machine"),
        }
    }
}
