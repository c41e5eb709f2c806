//! Compare two query answers: same columns, same rows (in order when the query orders), with
//! floating-point and decimal values equal to a relative 1e-6.

use arrow::array::{Array, ArrayRef, RecordBatch};
use arrow::compute::{cast, concat_batches};
use arrow::datatypes::DataType;
use arrow::util::display::array_value_to_string;

#[derive(Debug, Clone, PartialEq)]
enum Value {
    Null,
    Num(f64),
    Text(String),
}

fn is_numeric(t: &DataType) -> bool {
    t.is_floating() || matches!(t, DataType::Decimal128(_, _) | DataType::Decimal256(_, _))
}

fn rows(batches: &[RecordBatch]) -> Result<Vec<Vec<Value>>, String> {
    let Some(first) = batches.first() else {
        return Ok(vec![]);
    };
    let all = concat_batches(&first.schema(), batches).map_err(|e| e.to_string())?;
    let cols: Vec<(bool, ArrayRef)> = all
        .columns()
        .iter()
        .map(|c| {
            if is_numeric(c.data_type()) {
                cast(c, &DataType::Float64).map(|a| (true, a))
            } else {
                Ok((false, c.clone()))
            }
        })
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    (0..all.num_rows())
        .map(|r| {
            cols.iter()
                .map(|(num, c)| {
                    if c.is_null(r) {
                        Ok(Value::Null)
                    } else if *num {
                        let f = c
                            .as_any()
                            .downcast_ref::<arrow::array::Float64Array>()
                            .ok_or("not a float column")?;
                        Ok(Value::Num(f.value(r)))
                    } else {
                        array_value_to_string(c, r)
                            .map(Value::Text)
                            .map_err(|e| e.to_string())
                    }
                })
                .collect()
        })
        .collect()
}

fn close(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Num(x), Value::Num(y)) => {
            x == y || (x - y).abs() <= 1e-6 * x.abs().max(y.abs()).max(1e-9)
        }
        _ => a == b,
    }
}

fn sort_key(row: &[Value]) -> Vec<String> {
    row.iter()
        .map(|v| match v {
            Value::Null => String::new(),
            Value::Num(f) => format!("{:020.4}", f),
            Value::Text(s) => s.clone(),
        })
        .collect()
}

fn same_rows(a: &[Value], b: &[Value]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| close(x, y))
}

/// The rows of `a` and `b` are the same multiset.
fn same_multiset(a: &[Vec<Value>], b: &[Vec<Value>]) -> bool {
    let (mut a, mut b) = (a.to_vec(), b.to_vec());
    a.sort_by_key(|r| sort_key(r));
    b.sort_by_key(|r| sort_key(r));
    a.iter().zip(&b).all(|(x, y)| same_rows(x, y))
}

/// Rows tied on the ORDER BY keys may come in either order; ties are adjacent, so a short run
/// of differing positions must hold the same rows on both sides.
const MAX_TIE_RUN: usize = 64;

/// `Ok` when `got` matches `expected`; `ordered` compares row order too.
pub fn compare(expected: &[RecordBatch], got: &[RecordBatch], ordered: bool) -> Result<(), String> {
    let (mut e, mut g) = (rows(expected)?, rows(got)?);
    if e.len() != g.len() {
        return Err(format!("{} rows expected, {} returned", e.len(), g.len()));
    }
    if !ordered {
        e.sort_by_key(|r| sort_key(r));
        g.sort_by_key(|r| sort_key(r));
    }
    let mut i = 0;
    while i < e.len() {
        if same_rows(&e[i], &g[i]) {
            i += 1;
            continue;
        }
        let end = (i + 2..=e.len().min(i + MAX_TIE_RUN))
            .find(|&j| same_multiset(&e[i..j], &g[i..j]))
            .filter(|_| ordered);
        match end {
            Some(j) => i = j,
            None => {
                return Err(format!(
                    "row {i} differs: expected {:?}, got {:?}",
                    e[i], g[i]
                ))
            }
        }
    }
    Ok(())
}
