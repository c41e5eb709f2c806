//! Prepared statements' parameters over Flight SQL: the parameter schema of a statement's
//! placeholders (`$1`, `$2`, ...), and the values a client binds with `DoPut` (one row).

use arrow::array::{Array, RecordBatch};
use arrow::datatypes::{DataType, Schema};
use datafusion::common::{ParamValues, ScalarValue};
use tonic::Status;

pub(super) fn no_statement(h: &str) -> Status {
    Status::not_found(format!(
        "no prepared statement {h:?} (closed, or never made)"
    ))
}

/// A schema as the IPC message Flight SQL carries.
pub(super) fn ipc_schema(schema: &arrow::datatypes::Schema) -> Result<prost::bytes::Bytes, Status> {
    let options = arrow::ipc::writer::IpcWriteOptions::default();
    arrow_flight::IpcMessage::try_from(arrow_flight::SchemaAsIpc::new(schema, &options))
        .map(|m| m.0)
        .map_err(|e| Status::internal(e.to_string()))
}

/// The placeholders of `plan` (`$1`, `$2`, ...) as a schema of one field each, in order; a
/// type DataFusion cannot infer is `Null` (any value binds). Named placeholders are refused.
pub(super) fn parameter_schema(
    plan: &datafusion::logical_expr::LogicalPlan,
) -> Result<arrow::datatypes::Schema, Status> {
    let types = plan
        .get_parameter_types()
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    let mut numbered = Vec::with_capacity(types.len());
    for (name, ty) in types {
        let n: usize = name
            .strip_prefix('$')
            .and_then(|n| n.parse().ok())
            .filter(|&n| n >= 1)
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "placeholder {name}: only positional ones ($1, $2, ...) are supported"
                ))
            })?;
        numbered.push((n, name, ty.unwrap_or(arrow::datatypes::DataType::Null)));
    }
    numbered.sort_by_key(|(n, _, _)| *n);
    if let Some(gap) = numbered
        .iter()
        .enumerate()
        .find(|(i, (n, _, _))| *n != i + 1)
    {
        return Err(Status::invalid_argument(format!(
            "placeholders must be numbered $1 to $N without gaps; ${} is missing",
            gap.0 + 1
        )));
    }
    Ok(arrow::datatypes::Schema::new(
        numbered
            .into_iter()
            .map(|(_, name, ty)| arrow::datatypes::Field::new(name, ty, true))
            .collect::<Vec<_>>(),
    ))
}

const STRICT: arrow::compute::CastOptions<'static> = arrow::compute::CastOptions {
    safe: false,
    format_options: arrow::util::display::FormatOptions::new(),
};

/// The values of one execution: the single row of `batches`, one column per placeholder of
/// `wanted`, each cast to its placeholder's type where DataFusion inferred one (a client's
/// 64-bit integer binds to a 32-bit column, a string to a date).
pub(super) fn bind(batches: &[RecordBatch], wanted: &Schema) -> Result<ParamValues, Status> {
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let Some(batch) = batches.iter().find(|b| b.num_rows() > 0) else {
        return Err(Status::invalid_argument(
            "no parameter values: send one row, a column per placeholder",
        ));
    };
    if rows != 1 {
        return Err(Status::invalid_argument(format!(
            "{rows} rows of parameters: a query takes one row per execution"
        )));
    }
    if batch.num_columns() != wanted.fields().len() {
        return Err(Status::invalid_argument(format!(
            "{} parameter value(s) for {} placeholder(s)",
            batch.num_columns(),
            wanted.fields().len()
        )));
    }
    let mut values = Vec::with_capacity(batch.num_columns());
    for (column, field) in batch.columns().iter().zip(wanted.fields()) {
        let row = column.slice(batch.num_rows() - 1, 1);
        let typed = match field.data_type() {
            DataType::Null => row,
            t if t == row.data_type() => row,
            // Not `safe`: a value that does not convert is an error, not a null.
            t => arrow::compute::cast_with_options(&row, t, &STRICT).map_err(|e| {
                Status::invalid_argument(format!(
                    "parameter {} takes {t}, and {} does not convert: {e}",
                    field.name(),
                    row.data_type()
                ))
            })?,
        };
        let value = ScalarValue::try_from_array(&typed, 0).map_err(|e| {
            Status::invalid_argument(format!("unusable value of {}: {e}", field.name()))
        })?;
        values.push(value);
    }
    Ok(ParamValues::from(values))
}

/// `sql` with each `?` placeholder (JDBC's) numbered in order as `$1`, `$2`, ... (found by
/// sqlparser's tokenizer: a `?` inside a string or a comment stays); the text unchanged when it
/// has none. Mixing `?` with numbered placeholders is refused.
pub(super) fn positional(sql: &str) -> Result<String, Status> {
    use datafusion::sql::sqlparser::dialect::GenericDialect;
    use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer};
    let tokens = Tokenizer::new(&GenericDialect {}, sql)
        .tokenize_with_location()
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    let mut marks = Vec::new();
    let mut numbered = false;
    for t in &tokens {
        match &t.token {
            Token::Placeholder(p) if p == "?" => {
                marks.push((t.span.start.line, t.span.start.column))
            }
            Token::Placeholder(_) => numbered = true,
            _ => {}
        }
    }
    if marks.is_empty() {
        return Ok(sql.to_string());
    }
    if numbered {
        return Err(Status::invalid_argument(
            "use either ? or numbered placeholders ($1, ...), not both",
        ));
    }
    // (line, column), both from 1, counted in characters, to byte offsets.
    let (mut line, mut column) = (1u64, 1u64);
    let mut at = Vec::with_capacity(marks.len());
    for (offset, ch) in sql.char_indices() {
        if marks.contains(&(line, column)) {
            at.push(offset);
        }
        if ch == '\n' {
            line += 1;
            column = 1;
        } else {
            column += 1;
        }
    }
    if at.len() != marks.len() {
        return Err(Status::internal("could not place the ? placeholders"));
    }
    let mut out = String::with_capacity(sql.len() + 2 * at.len());
    let mut last = 0;
    for (i, offset) in at.iter().enumerate() {
        out.push_str(&sql[last..*offset]);
        out.push_str(&format!("${}", i + 1));
        last = offset + 1;
    }
    out.push_str(&sql[last..]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn question_marks_are_numbered_outside_strings_and_comments() {
        let sql = "SELECT '?', x FROM t -- ?\nWHERE a = ? AND b = 'it''s ?' AND c = ?";
        assert_eq!(
            super::positional(sql).unwrap(),
            "SELECT '?', x FROM t -- ?\nWHERE a = $1 AND b = 'it''s ?' AND c = $2"
        );
        assert_eq!(super::positional("SELECT 1").unwrap(), "SELECT 1");
        assert!(super::positional("SELECT ?, $1").is_err());
    }
}
