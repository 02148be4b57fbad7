//! The caller's deadline as gRPC carries it: the `grpc-timeout` header, what is left of
//! the caller's budget when the request was sent. Every server reads it the same way, and
//! passes what is left on to the calls it makes for the request.

use std::time::Duration;

/// Parses the `grpc-timeout` header (`<digits><H|M|S|m|u|n>`); `None` when absent or
/// malformed.
pub fn grpc_timeout(meta: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let v = meta.get("grpc-timeout")?.to_str().ok()?;
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_malformed_values() {
        let at = |v: &str| {
            let mut m = tonic::metadata::MetadataMap::new();
            m.insert("grpc-timeout", v.parse().unwrap());
            grpc_timeout(&m)
        };
        assert_eq!(at("3S"), Some(Duration::from_secs(3)));
        assert_eq!(at("250m"), Some(Duration::from_millis(250)));
        assert_eq!(at("2M"), Some(Duration::from_secs(120)));
        assert_eq!(at("7u"), Some(Duration::from_micros(7)));
        assert_eq!(at("12x"), None);
        assert_eq!(at("S"), None);
        assert_eq!(grpc_timeout(&tonic::metadata::MetadataMap::new()), None);
    }
}
