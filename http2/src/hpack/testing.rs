//! Test support for HPACK users: a reference encoder and decoding helpers, for
//! this crate's tests and (feature `testing`) its dependents' tests.

use bytes::{BufMut, BytesMut};
use proptest::prelude::*;

use super::*;

/// Decoded fields: name, value, indexing.
pub type Fields = Vec<(Vec<u8>, Vec<u8>, Indexing)>;

/// Every field of `block`, as sent.
pub fn decode_all(decoder: &mut Decoder, block: &[u8]) -> Result<Fields, DecodeError> {
    let mut fields = Vec::new();
    decoder.decode(block, |name, value, indexing| {
        fields.push((name.to_vec(), value.to_vec(), indexing));
    })?;
    Ok(fields)
}

/// The canonical code, rebuilt from the lengths: (code, length) per symbol.
pub fn huffman_codes() -> Vec<(u32, u8)> {
    let mut order: Vec<usize> = (0..257).collect();
    order.sort_by_key(|&s| (HUFFMAN_LENGTHS[s], s));
    let mut codes = vec![(0u32, 0u8); 257];
    let mut code = 0u32;
    let mut previous = HUFFMAN_LENGTHS[order[0]];
    for (i, &symbol) in order.iter().enumerate() {
        let len = HUFFMAN_LENGTHS[symbol];
        if i > 0 {
            code = (code + 1) << (len - previous);
        }
        codes[symbol] = (code, len);
        previous = len;
    }
    codes
}

/// Huffman-codes `text` with EOS padding, as an encoder would.
pub fn huffman_encode(text: &[u8]) -> Vec<u8> {
    let codes = huffman_codes();
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u64, 0u32);
    for &byte in text {
        let (code, len) = codes[usize::from(byte)];
        acc = acc << len | u64::from(code);
        bits += u32::from(len);
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        out.push((acc << (8 - bits)) as u8 | (0xff >> bits));
    }
    out
}

/// How a test encoder writes one field.
#[derive(Debug, Clone, Copy)]
pub enum Representation {
    /// Literal with incremental indexing.
    WithIndexing,
    /// Literal without indexing.
    WithoutIndexing,
    /// Literal never indexed.
    NeverIndexed,
}

/// A reference encoder with its own table, independent of the decoder's code:
/// fields already in its table go as indices, the rest as literals, names and
/// values Huffman-coded or raw as told.
#[derive(Debug)]
pub struct TestEncoder {
    /// Its dynamic table, newest first.
    pub table: Vec<(Vec<u8>, Vec<u8>)>,
    /// The table's size, as HPACK counts it.
    pub size: usize,
    /// The table's maximum size.
    pub max: usize,
}

impl TestEncoder {
    /// Appends `fields` (and a table resize first, when given) to `block`.
    pub fn encode(
        &mut self,
        fields: &[(Vec<u8>, Vec<u8>, Representation, bool)],
        resize: Option<usize>,
        block: &mut BytesMut,
    ) {
        if let Some(max) = resize {
            encode_int(max, 5, 0x20, block);
            self.max = max;
            self.evict(max);
        }
        for (name, value, representation, huffman) in fields {
            let found = STATIC_TABLE
                .iter()
                .map(|(n, v)| (n.to_vec(), v.to_vec()))
                .chain(self.table.iter().cloned())
                .position(|(n, v)| n == *name && v == *value);
            if let (Some(index), Representation::WithIndexing) = (found, representation) {
                encode_int(index + 1, 7, 0x80, block);
                continue;
            }
            let (prefix, flags) = match representation {
                Representation::WithIndexing => (6, 0x40),
                Representation::WithoutIndexing => (4, 0x00),
                Representation::NeverIndexed => (4, 0x10),
            };
            encode_int(0, prefix, flags, block);
            for string in [name, value] {
                if *huffman {
                    let coded = huffman_encode(string);
                    encode_int(coded.len(), 7, 0x80, block);
                    block.put_slice(&coded);
                } else {
                    encode_int(string.len(), 7, 0x00, block);
                    block.put_slice(string);
                }
            }
            if let Representation::WithIndexing = representation {
                let size = name.len() + value.len() + 32;
                if size > self.max {
                    self.table.clear();
                    self.size = 0;
                } else {
                    self.evict(self.max - size);
                    self.table.insert(0, (name.clone(), value.clone()));
                    self.size += size;
                }
            }
        }
    }

    fn evict(&mut self, limit: usize) {
        while self.size > limit {
            let (n, v) = self.table.pop().expect("entries while size > 0");
            self.size -= n.len() + v.len() + 32;
        }
    }
}

/// Any representation.
pub fn representation() -> impl Strategy<Value = Representation> {
    prop_oneof![
        Just(Representation::WithIndexing),
        Just(Representation::WithoutIndexing),
        Just(Representation::NeverIndexed),
    ]
}
