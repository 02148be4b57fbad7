//! Describes every metric of the catalogue to the installed recorder (help text on
//! `/metrics`), once at start-up.

use crate::names::{Kind, CATALOGUE};

/// Registers the help text of every metric in [`CATALOGUE`](crate::names::CATALOGUE).
pub fn describe_all() {
    for m in CATALOGUE {
        match m.kind {
            Kind::Counter => metrics::describe_counter!(m.name, m.help),
            Kind::Gauge => metrics::describe_gauge!(m.name, m.help),
            Kind::Histogram => metrics::describe_histogram!(m.name, m.help),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::exporter::HISTOGRAM_BUCKETS;
    use crate::names::{Kind, CATALOGUE};

    #[test]
    fn names_follow_the_convention() {
        let mut seen = std::collections::HashSet::new();
        for m in CATALOGUE {
            assert!(seen.insert(m.name), "{} declared twice", m.name);
            assert!(m.name.starts_with("duet_"), "{}", m.name);
            assert!(
                m.name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{}",
                m.name
            );
            assert_eq!(
                m.name.ends_with("_total"),
                m.kind == Kind::Counter,
                "{}: `_total` exactly on counters",
                m.name
            );
            assert!(!m.help.is_empty(), "{} has no help", m.name);
        }
    }

    #[test]
    fn every_histogram_has_buckets_and_only_histograms_do() {
        for m in CATALOGUE.iter().filter(|m| m.kind == Kind::Histogram) {
            let b = HISTOGRAM_BUCKETS.iter().find(|(n, _)| *n == m.name);
            let (_, b) = b.unwrap_or_else(|| panic!("{} has no buckets", m.name));
            assert!(
                b.windows(2).all(|w| w[0] < w[1]),
                "{} buckets not increasing",
                m.name
            );
        }
        for (n, _) in HISTOGRAM_BUCKETS {
            let m = CATALOGUE.iter().find(|m| m.name == *n);
            assert_eq!(m.map(|m| m.kind), Some(Kind::Histogram), "{n}");
        }
    }
}
