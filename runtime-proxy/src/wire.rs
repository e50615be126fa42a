//! Protobuf wire-level splicing, so a request the proxy rewrote keeps every
//! field its CRI types do not know.
//!
//! prost drops unknown fields when it decodes. Rather than re-encode a rewritten
//! message from the typed value alone, [`merge`] starts from the original bytes
//! and replaces only what the rewrite changed, recursing into sub-messages so an
//! unknown field deep inside `ContainerConfig` survives a change to its `envs`.
//! It needs no schema: a field is "known" when the typed re-encoding emits it.

use std::collections::HashSet;

/// Why bytes could not be read as protobuf wire format.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// A varint ran past the end of the buffer or past 10 bytes.
    #[error("malformed varint at byte {0}")]
    Varint(usize),
    /// A field's payload runs past the end of the buffer.
    #[error("field at byte {0} runs past the end of the message")]
    Truncated(usize),
    /// A wire type the protobuf encoding does not define.
    #[error("invalid wire type {wire_type} at byte {at}")]
    WireType { wire_type: u8, at: usize },
    /// A group start without its end, or an end without a start.
    #[error("unbalanced group at byte {0}")]
    Group(usize),
}

const LEN: u8 = 2;

/// One field occurrence: its number, wire type, its whole encoding (tag
/// included) and, for length-delimited fields, the payload.
#[derive(Debug, Clone, Copy)]
struct Field<'a> {
    number: u64,
    wire_type: u8,
    raw: &'a [u8],
    payload: &'a [u8],
}

fn read_varint(buf: &[u8], at: &mut usize) -> Result<u64, WireError> {
    let start = *at;
    let mut value = 0u64;
    for shift in 0..10 {
        let byte = *buf.get(*at).ok_or(WireError::Varint(start))?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << (7 * shift);
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(WireError::Varint(start))
}

fn take(buf: &[u8], at: &mut usize, n: usize, start: usize) -> Result<(), WireError> {
    let end = at
        .checked_add(n)
        .filter(|end| *end <= buf.len())
        .ok_or(WireError::Truncated(start))?;
    *at = end;
    Ok(())
}

/// Skips one field body of `wire_type` starting at `at`; returns the payload range for LEN.
fn skip_body(
    buf: &[u8],
    at: &mut usize,
    number: u64,
    wire_type: u8,
    start: usize,
) -> Result<(usize, usize), WireError> {
    match wire_type {
        0 => {
            read_varint(buf, at)?;
        }
        1 => take(buf, at, 8, start)?,
        5 => take(buf, at, 4, start)?,
        LEN => {
            let len =
                usize::try_from(read_varint(buf, at)?).map_err(|_| WireError::Truncated(start))?;
            let from = *at;
            take(buf, at, len, start)?;
            return Ok((from, *at));
        }
        3 => loop {
            let tag_at = *at;
            if tag_at >= buf.len() {
                return Err(WireError::Group(start));
            }
            let tag = read_varint(buf, at)?;
            let (inner_number, inner_type) = (tag >> 3, (tag & 7) as u8);
            if inner_type == 4 {
                if inner_number != number {
                    return Err(WireError::Group(tag_at));
                }
                break;
            }
            skip_body(buf, at, inner_number, inner_type, tag_at)?;
        },
        4 => return Err(WireError::Group(start)),
        other => {
            return Err(WireError::WireType {
                wire_type: other,
                at: start,
            });
        }
    }
    Ok((*at, *at))
}

fn parse(buf: &[u8]) -> Result<Vec<Field<'_>>, WireError> {
    let mut fields = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        let start = at;
        let tag = read_varint(buf, &mut at)?;
        let (number, wire_type) = (tag >> 3, (tag & 7) as u8);
        if number == 0 {
            return Err(WireError::WireType {
                wire_type,
                at: start,
            });
        }
        let (from, to) = skip_body(buf, &mut at, number, wire_type, start)?;
        fields.push(Field {
            number,
            wire_type,
            raw: &buf[start..at],
            payload: &buf[from..to],
        });
    }
    Ok(fields)
}

fn write_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Rebuilds `updated` (the typed re-encoding of the rewritten message) on top of
/// `original` (the bytes received), where `decoded` is the typed re-encoding of
/// `original` before the rewrite.
///
/// Fields the typed encoding does not emit are kept from `original` in place;
/// unchanged known fields keep their original bytes; changed sub-messages are
/// merged recursively, so unknown fields inside them survive too.
pub fn merge(original: &[u8], decoded: &[u8], updated: &[u8]) -> Result<Vec<u8>, WireError> {
    if decoded == updated {
        return Ok(original.to_vec());
    }
    let original_fields = parse(original)?;
    let decoded_fields = parse(decoded)?;
    let updated_fields = parse(updated)?;
    let known: HashSet<u64> = decoded_fields
        .iter()
        .chain(&updated_fields)
        .map(|field| field.number)
        .collect();

    let mut out = Vec::with_capacity(updated.len() + original.len().saturating_sub(decoded.len()));
    let mut emitted = HashSet::new();
    let emit = |out: &mut Vec<u8>, number: u64| {
        merge_known(
            out,
            &occurrences(&original_fields, number),
            &occurrences(&decoded_fields, number),
            &occurrences(&updated_fields, number),
        );
    };
    for field in &original_fields {
        if !known.contains(&field.number) {
            out.extend_from_slice(field.raw);
        } else if emitted.insert(field.number) {
            emit(&mut out, field.number);
        }
    }
    for field in &updated_fields {
        if emitted.insert(field.number) {
            emit(&mut out, field.number);
        }
    }
    Ok(out)
}

fn occurrences<'a>(fields: &[Field<'a>], number: u64) -> Vec<Field<'a>> {
    fields
        .iter()
        .filter(|field| field.number == number)
        .copied()
        .collect()
}

/// Emits the updated occurrences of one known field number.
fn merge_known(
    out: &mut Vec<u8>,
    original: &[Field<'_>],
    decoded: &[Field<'_>],
    updated: &[Field<'_>],
) {
    // Original and decoded occurrences pair by position only when the sender
    // encoded the field the way prost does (no repeated singular fields).
    let paired = original.len() == decoded.len();
    let mut used = vec![false; decoded.len()];
    for (index, field) in updated.iter().enumerate() {
        if paired {
            let unchanged = (0..decoded.len()).find(|&i| !used[i] && decoded[i].raw == field.raw);
            if let Some(i) = unchanged {
                used[i] = true;
                out.extend_from_slice(original[i].raw);
                continue;
            }
            let same_slot = decoded.len() == updated.len() && !used[index];
            // Original bytes that differ from prost's re-encoding hold unknown fields.
            if same_slot
                && field.wire_type == LEN
                && original[index].wire_type == LEN
                && original[index].raw != decoded[index].raw
            {
                if let Ok(inner) = merge(
                    original[index].payload,
                    decoded[index].payload,
                    field.payload,
                ) {
                    used[index] = true;
                    write_varint(out, (field.number << 3) | u64::from(LEN));
                    write_varint(out, inner.len() as u64);
                    out.extend_from_slice(&inner);
                    continue;
                }
            }
        }
        out.extend_from_slice(field.raw);
    }
}

#[cfg(test)]
mod tests;
