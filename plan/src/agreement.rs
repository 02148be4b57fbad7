//! Whether a profile's rounds agree: `duet profile` measures its prefill and decode tables
//! several times over (whole tables, one round after the other, so that rounds are minutes
//! apart and a busy spell of the machine lands in one of them), keeps the median of each
//! point, and refuses the profile when two rounds disagree by more than asked.
//!
//! Why: on shared machines two profiles of the same binary, minutes apart, differed by
//! 20-33 % on prefill (docs/plan.md), more than the simulator's own error. A prediction is
//! only as good as the profile behind it, so the profile checks itself.
//!
//! A point's disagreement is `(max - min) / min` over its rounds; the profile's is the
//! largest over all points, named in the report.

use std::fmt;

use duet_bench::stats::median;

/// One round of a table: rows of seconds, every round of the same shape.
pub type Round = Vec<Vec<f64>>;

/// A named table's rounds, with the labels of its rows and columns for the report.
pub struct TableRounds<'a> {
    /// E.g. `prefill`.
    pub name: &'a str,
    /// Label of each row (e.g. `after 512 cached`) and of each column (`256 tokens`).
    pub rows: Vec<String>,
    pub cols: Vec<String>,
    pub rounds: &'a [Round],
}

/// How far apart a profile's rounds are.
#[derive(Debug, Clone, PartialEq)]
pub struct Agreement {
    pub rounds: usize,
    /// The largest disagreement of any point (0.07 = 7 %).
    pub worst: f64,
    /// Where it is (`prefill, 512 tokens after 0 cached`).
    pub worst_at: String,
    /// The median disagreement over all points.
    pub median: f64,
}

impl Agreement {
    /// Whether every point's rounds are within `tolerance` of each other.
    pub fn within(&self, tolerance: f64) -> bool {
        self.worst <= tolerance
    }
}

impl fmt::Display for Agreement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} rounds of the prefill and decode tables: largest disagreement {:.1} % ({}), \
             median {:.1} %",
            self.rounds,
            100.0 * self.worst,
            self.worst_at,
            100.0 * self.median
        )
    }
}

/// The point-wise median of `rounds` (all of one shape; empty rows for no rounds).
pub fn median_table(rounds: &[Round]) -> Round {
    let Some(first) = rounds.first() else {
        return Vec::new();
    };
    first
        .iter()
        .enumerate()
        .map(|(r, row)| {
            (0..row.len())
                .map(|c| median(rounds.iter().map(|t| t[r][c])).unwrap_or(0.0))
                .collect()
        })
        .collect()
}

/// How far apart the rounds of `tables` are (a single round agrees with itself: 0).
pub fn agreement(tables: &[TableRounds<'_>]) -> Agreement {
    let mut all = Vec::new();
    let mut worst = (0.0, String::from("no point"));
    let mut rounds = 0;
    for t in tables {
        rounds = rounds.max(t.rounds.len());
        let Some(first) = t.rounds.first() else {
            continue;
        };
        for (r, row) in first.iter().enumerate() {
            for c in 0..row.len() {
                let v = t.rounds.iter().map(|round| round[r][c]);
                let (lo, hi) = v.fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
                    (lo.min(x), hi.max(x))
                });
                let d = if lo > 0.0 { (hi - lo) / lo } else { 0.0 };
                all.push(d);
                if d > worst.0 {
                    let at = format!(
                        "{}, {} {}",
                        t.name,
                        t.cols.get(c).map_or("?", String::as_str),
                        t.rows.get(r).map_or("?", String::as_str)
                    );
                    worst = (d, at);
                }
            }
        }
    }
    Agreement {
        rounds,
        worst: worst.0,
        worst_at: worst.1,
        median: median(all).unwrap_or(0.0),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn table<'a>(name: &'a str, rounds: &'a [Round]) -> TableRounds<'a> {
        TableRounds {
            name,
            rows: vec!["after 0 cached".into(), "after 512 cached".into()],
            cols: vec!["16 tokens".into(), "256 tokens".into()],
            rounds,
        }
    }

    #[test]
    fn the_worst_point_is_named_and_measured_against_the_faster_round() {
        let prefill = [
            vec![vec![1.0, 2.0], vec![3.0, 4.0]],
            vec![vec![1.1, 2.0], vec![3.0, 5.0]],
        ];
        let decode = [vec![vec![0.010]], vec![vec![0.0102]]];
        let a = agreement(&[table("prefill", &prefill), table("decode", &decode)]);
        assert_eq!(a.rounds, 2);
        assert!((a.worst - 0.25).abs() < 1e-12, "{a:?}");
        assert_eq!(a.worst_at, "prefill, 256 tokens after 512 cached");
        // Points: 0.1, 0, 0, 0.25, 0.02: the median is 0.02.
        assert!((a.median - 0.02).abs() < 1e-9, "{a:?}");
        assert!(a.within(0.25) && !a.within(0.2));
        assert!(a.to_string().contains("largest disagreement 25.0 %"), "{a}");
    }

    #[test]
    fn one_round_agrees_with_itself_and_the_median_table_keeps_the_middle_round() {
        let one = [vec![vec![1.0, 2.0]]];
        let a = agreement(&[table("prefill", &one)]);
        assert_eq!((a.rounds, a.worst), (1, 0.0));
        let three = [
            vec![vec![1.0, 9.0]],
            vec![vec![3.0, 2.0]],
            vec![vec![2.0, 4.0]],
        ];
        assert_eq!(median_table(&three), vec![vec![2.0, 4.0]]);
        assert!(median_table(&[]).is_empty());
    }
}
