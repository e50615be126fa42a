//! Which system's names a container asked for its GPUs in, so that the node can
//! set the env that system's device plugin sets and its users' applications read
//! (gpushare's `ALIYUN_COM_GPU_MEM_*`, Volcano's `VOLCANO_GPU_*`), from the grant.
//!
//! tessera-scheduler writes the pod annotation [`REQUESTED_AS`] with the
//! allocation; the GPU hook reads it. It selects only which names carry the
//! grant's own figures, so a tenant who writes it gains nothing but env.

use std::collections::BTreeMap;

/// Pod annotation: `{"<container>": "gpushare:<unit bytes>" | "volcano:<unit bytes>"}`.
pub const REQUESTED_AS: &str = "tessera.io/requested-as";

/// A system whose device plugin's env a container gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AskedAs {
    /// gpushare (`aliyun.com/gpu-mem`), in its memory unit (bytes).
    Gpushare {
        /// Bytes per unit (GiB, or MiB with its `--memory-unit=MiB`).
        unit: u64,
    },
    /// Volcano's GPU share (`volcano.sh/gpu-memory`), in its unit (bytes).
    Volcano {
        /// Bytes per unit (MiB).
        unit: u64,
    },
}

impl AskedAs {
    fn encode(self) -> String {
        match self {
            AskedAs::Gpushare { unit } => format!("gpushare:{unit}"),
            AskedAs::Volcano { unit } => format!("volcano:{unit}"),
        }
    }

    fn parse(text: &str) -> Result<Self, String> {
        let (system, unit) = text
            .split_once(':')
            .ok_or_else(|| format!("{text:?}: expected SYSTEM:UNIT_BYTES"))?;
        let unit = unit
            .parse::<u64>()
            .ok()
            .filter(|u| *u > 0)
            .ok_or_else(|| format!("{text:?}: {unit:?} is not a positive number of bytes"))?;
        match system {
            "gpushare" => Ok(AskedAs::Gpushare { unit }),
            "volcano" => Ok(AskedAs::Volcano { unit }),
            other => Err(format!("{text:?}: {other:?} is not gpushare or volcano")),
        }
    }
}

/// The annotation's value for `asked` (container → system).
pub fn encode(asked: &BTreeMap<String, AskedAs>) -> String {
    let map: serde_json::Map<String, serde_json::Value> = asked
        .iter()
        .map(|(container, system)| (container.clone(), system.encode().into()))
        .collect();
    serde_json::Value::Object(map).to_string()
}

/// Reads [`encode`]'s form back, or says what is wrong with it.
pub fn parse(text: &str) -> Result<BTreeMap<String, AskedAs>, String> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let map = value
        .as_object()
        .ok_or_else(|| "expected a JSON object of container to system".to_owned())?;
    map.iter()
        .map(|(container, system)| {
            let text = system
                .as_str()
                .ok_or_else(|| format!("{container}: expected a string"))?;
            Ok((container.clone(), AskedAs::parse(text)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_names_mistakes() {
        let asked = BTreeMap::from([
            ("main".to_owned(), AskedAs::Gpushare { unit: 1 << 30 }),
            ("side".to_owned(), AskedAs::Volcano { unit: 1 << 20 }),
        ]);
        assert_eq!(parse(&encode(&asked)), Ok(asked));
        for bad in [
            "[]",
            r#"{"main": 1}"#,
            r#"{"main": "hami:1"}"#,
            r#"{"main": "gpushare:0"}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
