//! A measured cost table over two axes (e.g. prompt tokens × cached tokens, batch ×
//! context) and its interpolation.
//!
//! Between measured points the cost is bilinear; beyond the last point of an axis it is
//! extended along the line through the last two points (costs grow linearly in tokens and
//! in batch once the fixed part is paid), before the first point along the line through the
//! first two; a table with one point on an axis is constant along it. The result is never
//! below the smallest measured cost (an extrapolation below the first point cannot reach 0).
//!
//! Invariants after [`Table::new`]: both axes are non-empty and strictly increasing, every
//! cost is finite and positive, and `z[j][i]` is the cost at `(x[i], y[j])`.

use crate::error::{PlanError, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    x: Vec<f64>,
    y: Vec<f64>,
    z: Vec<Vec<f64>>,
    floor: f64,
}

fn check_axis(at: &str, name: &str, v: &[f64]) -> Result<()> {
    if v.is_empty() {
        return Err(PlanError::input(at, name, "empty"));
    }
    if let Some(i) = v.iter().position(|x| !x.is_finite() || *x < 0.0) {
        return Err(PlanError::input(
            at,
            format!("{name}[{i}]"),
            format!("{} is not a finite number >= 0", v[i]),
        ));
    }
    if let Some(i) = v.windows(2).position(|w| w[1] <= w[0]) {
        return Err(PlanError::input(
            at,
            format!("{name}[{}]", i + 1),
            "the axis must be strictly increasing",
        ));
    }
    Ok(())
}

/// `t` of the way from `a` to `b` (extrapolating when `t` is outside [0, 1]).
fn lerp(a: f64, b: f64, t: f64) -> f64 {
    a + (b - a) * t
}

/// The segment of `axis` that `v` falls in (or extends), and `v`'s position along it.
fn locate(axis: &[f64], v: f64) -> (usize, usize, f64) {
    if axis.len() == 1 {
        return (0, 0, 0.0);
    }
    let i = match axis.iter().position(|&a| a > v) {
        None => axis.len() - 2,
        Some(0) => 0,
        Some(k) => k - 1,
    };
    let (a, b) = (axis[i], axis[i + 1]);
    (i, i + 1, (v - a) / (b - a))
}

impl Table {
    /// `at`: the file and table name errors are reported against; `names`: the axes' and
    /// the cost's field names.
    pub fn new(
        at: &str,
        names: [&str; 3],
        x: Vec<f64>,
        y: Vec<f64>,
        z: Vec<Vec<f64>>,
    ) -> Result<Table> {
        check_axis(at, names[0], &x)?;
        check_axis(at, names[1], &y)?;
        if z.len() != y.len() {
            return Err(PlanError::input(
                at,
                names[2],
                format!("{} rows for {} values of {}", z.len(), y.len(), names[1]),
            ));
        }
        let mut floor = f64::INFINITY;
        for (j, row) in z.iter().enumerate() {
            if row.len() != x.len() {
                return Err(PlanError::input(
                    at,
                    format!("{}[{j}]", names[2]),
                    format!(
                        "{} values for {} values of {}",
                        row.len(),
                        x.len(),
                        names[0]
                    ),
                ));
            }
            for (i, &c) in row.iter().enumerate() {
                if !(c.is_finite() && c > 0.0) {
                    return Err(PlanError::input(
                        at,
                        format!("{}[{j}][{i}]", names[2]),
                        format!("{c} is not a positive time"),
                    ));
                }
                floor = floor.min(c);
            }
        }
        Ok(Table { x, y, z, floor })
    }

    /// The cost at `(x, y)`.
    pub fn at(&self, x: f64, y: f64) -> f64 {
        let (i0, i1, tx) = locate(&self.x, x);
        let (j0, j1, ty) = locate(&self.y, y);
        let row = |j: usize| lerp(self.z[j][i0], self.z[j][i1], tx);
        lerp(row(j0), row(j1), ty).max(self.floor)
    }

    /// The second axis's values.
    pub fn y(&self) -> &[f64] {
        &self.y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t() -> Table {
        Table::new(
            "p",
            ["x", "y", "z"],
            vec![1.0, 3.0],
            vec![0.0, 10.0],
            vec![vec![1.0, 3.0], vec![2.0, 4.0]],
        )
        .unwrap()
    }

    #[test]
    fn interpolates_inside_and_extends_outside_linearly() {
        let t = t();
        assert_eq!(t.at(1.0, 0.0), 1.0);
        assert_eq!(t.at(2.0, 0.0), 2.0);
        assert_eq!(t.at(2.0, 5.0), 2.5);
        // Beyond the last x: the line through the last two points.
        assert_eq!(t.at(5.0, 0.0), 5.0);
        // Beyond the last y too.
        assert_eq!(t.at(3.0, 20.0), 5.0);
        // Below the first point: never below the smallest measured cost.
        assert_eq!(t.at(0.0, 0.0), 1.0);
    }

    #[test]
    fn one_point_axes_are_constant() {
        let t = Table::new("p", ["x", "y", "z"], vec![4.0], vec![0.0], vec![vec![0.5]]).unwrap();
        assert_eq!(t.at(100.0, 7.0), 0.5);
    }

    #[test]
    fn bad_tables_name_the_field() {
        let e = |x: Vec<f64>, z: Vec<Vec<f64>>| {
            Table::new(
                "f.json: prefill",
                ["tokens", "cached", "seconds"],
                x,
                vec![0.0],
                z,
            )
            .unwrap_err()
            .to_string()
        };
        assert!(e(vec![2.0, 1.0], vec![vec![1.0, 1.0]]).contains("tokens[1]"));
        assert!(e(vec![1.0, 2.0], vec![vec![1.0, -1.0]]).contains("seconds[0][1]"));
        assert!(e(vec![1.0, 2.0], vec![vec![1.0]]).contains("seconds[0]"));
        assert!(e(vec![], vec![vec![]]).contains("tokens: empty"));
    }
}
