//! HPACK (RFC 7541) for the kubelet side of the connection: a decoder that tracks
//! kubelet's dynamic table through every request header block, and the plain
//! encoding ([`encode_literal`]) the proxy re-emits a block in when it must change
//! one, which needs no Huffman code and no table on the receiving side.
//!
//! The decoder is strict where h2's is, so that a block it accepts is one h2
//! accepts: the same integer limit (5 octets), index 0 and indices past the table
//! refused, table size updates only before the first field and never above the
//! size h2 advertised, Huffman strings without EOS and with at most 7 bits of
//! all-ones padding. Names and values are not checked: that is h2's job, on the
//! block the proxy passes on.
//!
//! Written here rather than taken from a crate: h2's own HPACK is private, and the
//! published ones are unmaintained (`hpack` 0.3, 2016; `hpack_codec`, 2018), panic
//! on a truncated block (`httlib-hpack` 0.1) or build a hash-map Huffman table for
//! every string they decode (`loona-hpack` 0.4, from the experimental loona), and
//! none is fuzzed. This one has no `unsafe`, allocates only what enters the
//! table, has a fuzz target (`runtime-proxy/fuzz`, `kubelet_frames`) and RFC 7541's
//! examples and round trips as tests; a kubelet call's block takes it well under
//! a microsecond.

use std::collections::VecDeque;

use bytes::{BufMut, BytesMut};

/// HPACK's per-entry overhead in the table and header-list size (RFC 7541 §4.1).
const ENTRY_OVERHEAD: usize = 32;

/// Why a header block could not be decoded: for HTTP/2, a connection error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The block ends inside a field, an integer or a string.
    #[error("header block ends inside a field")]
    Truncated,
    /// An integer takes more than the 5 octets h2 accepts.
    #[error("integer longer than 5 octets")]
    IntegerTooLong,
    /// A field refers to table index 0, which names nothing.
    #[error("table index 0")]
    IndexZero,
    /// A field refers to an index past the static and dynamic tables.
    #[error("table index {index} past the table's {len} entries")]
    IndexPastTable {
        /// The index the field names.
        index: usize,
        /// Entries in the static and dynamic tables together.
        len: usize,
    },
    /// A dynamic table size update asks for more than the decoder allows.
    #[error("table size update to {size} above the allowed {max}")]
    TableSizeTooLarge {
        /// The size asked for.
        size: usize,
        /// The size the receiver advertised.
        max: usize,
    },
    /// A dynamic table size update follows a field of the same block.
    #[error("table size update after a header field")]
    TableSizeUpdateLate,
    /// A Huffman string contains the EOS symbol.
    #[error("Huffman string contains EOS")]
    HuffmanEos,
    /// A Huffman string ends in more than 7 bits, or in bits that are not all ones.
    #[error("Huffman string badly padded")]
    HuffmanPadding,
}

/// How a field was sent, where it matters to the one who passes it on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Indexing {
    /// Indexed, or a literal that may be indexed downstream.
    Allowed,
    /// A literal "never indexed" (RFC 7541 §6.2.3): re-emitted the same way.
    Never,
}

// === impl Decoder ===

/// The decoding side of one connection: its dynamic table lives as long as it does.
#[derive(Debug)]
pub struct Decoder {
    table: DynamicTable,
    /// Table inserts and size updates so far.
    changes: u64,
    max_allowed: usize,
    /// Huffman-decoded name and value, reused from field to field.
    name: Vec<u8>,
    value: Vec<u8>,
}

impl Decoder {
    /// A decoder whose table may grow to `max_table_size`, the
    /// SETTINGS_HEADER_TABLE_SIZE its side of the connection advertised.
    pub fn new(max_table_size: usize) -> Self {
        Self {
            table: DynamicTable::new(max_table_size),
            changes: 0,
            max_allowed: max_table_size,
            name: Vec::new(),
            value: Vec::new(),
        }
    }

    /// How many times blocks changed the dynamic table (inserts and size updates):
    /// one who drops a block, or a field of it, can tell whether the receiver's
    /// table would still match.
    pub fn table_changes(&self) -> u64 {
        self.changes
    }

    /// The dynamic table's size (§4.1): what the sender's encoder counts too.
    pub fn table_size(&self) -> usize {
        self.table.size
    }

    /// Sets the largest table size update this decoder accepts: the
    /// SETTINGS_HEADER_TABLE_SIZE its side of the connection advertised. The table
    /// itself changes size only when the encoder says so (§4.2).
    pub fn set_max_allowed(&mut self, max_table_size: usize) {
        self.max_allowed = max_table_size;
    }

    /// Decodes one whole header block (every fragment of a HEADERS frame and its
    /// CONTINUATIONs), updating the dynamic table as its sender did, and hands
    /// each field to `each` as (name, value, indexing), in order. Nothing is
    /// allocated per field but what enters the table.
    pub fn decode(
        &mut self,
        block: &[u8],
        mut each: impl FnMut(&[u8], &[u8], Indexing),
    ) -> Result<(), DecodeError> {
        let Self {
            table,
            changes,
            max_allowed,
            name: name_buf,
            value: value_buf,
        } = self;
        let mut pos = 0;
        let mut may_resize = true;
        while let Some(&first) = block.get(pos) {
            if first & 0xe0 == 0x20 {
                // Dynamic table size update (§6.3): before any field only.
                if !may_resize {
                    return Err(DecodeError::TableSizeUpdateLate);
                }
                let size = decode_int(block, &mut pos, 5)?;
                if size > *max_allowed {
                    return Err(DecodeError::TableSizeTooLarge {
                        size,
                        max: *max_allowed,
                    });
                }
                table.resize(size);
                *changes += 1;
                continue;
            }
            may_resize = false;
            if first & 0x80 != 0 {
                // Indexed field (§6.1).
                let index = decode_int(block, &mut pos, 7)?;
                let (name, value) = table.get(index)?;
                each(name, value, Indexing::Allowed);
                continue;
            }
            // Literals: with incremental indexing (01), without (0000), never
            // indexed (0001) (§6.2).
            let (prefix, indexing) = match first {
                0x40.. => (6, Indexing::Allowed),
                0x10.. => (4, Indexing::Never),
                _ => (4, Indexing::Allowed),
            };
            let index = decode_int(block, &mut pos, prefix)?;
            let name = if index == 0 {
                decode_string(block, &mut pos, name_buf)?
            } else {
                table.get(index)?.0
            };
            let value = decode_string(block, &mut pos, value_buf)?;
            each(name, value, indexing);
            if prefix == 6 {
                let entry = Entry::new(name, value);
                table.insert(entry);
                *changes += 1;
            }
        }
        Ok(())
    }
}

/// One table entry: name and value in one allocation.
#[derive(Debug)]
struct Entry {
    bytes: Box<[u8]>,
    name_len: usize,
}

impl Entry {
    fn new(name: &[u8], value: &[u8]) -> Self {
        Self {
            bytes: [name, value].concat().into_boxed_slice(),
            name_len: name.len(),
        }
    }

    fn split(&self) -> (&[u8], &[u8]) {
        self.bytes.split_at(self.name_len)
    }

    /// Its size in the table: name + value + 32 octets (§4.1).
    fn size(&self) -> usize {
        self.bytes.len() + ENTRY_OVERHEAD
    }
}

/// The dynamic table (§2.3.2, §4): newest entry first, evicted from the back.
#[derive(Debug)]
struct DynamicTable {
    entries: VecDeque<Entry>,
    size: usize,
    max_size: usize,
}

impl DynamicTable {
    fn new(max_size: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            size: 0,
            max_size,
        }
    }

    /// Entry `index` of the static table and this one together (§2.3.3).
    fn get(&self, index: usize) -> Result<(&[u8], &[u8]), DecodeError> {
        match index {
            0 => Err(DecodeError::IndexZero),
            1..=STATIC_LEN => Ok(STATIC_TABLE[index - 1]),
            _ => self
                .entries
                .get(index - STATIC_LEN - 1)
                .map(Entry::split)
                .ok_or(DecodeError::IndexPastTable {
                    index,
                    len: STATIC_LEN + self.entries.len(),
                }),
        }
    }

    fn insert(&mut self, entry: Entry) {
        let size = entry.size();
        if size > self.max_size {
            // §4.4: an entry larger than the table empties it.
            self.entries.clear();
            self.size = 0;
            return;
        }
        self.evict_to(self.max_size - size);
        self.entries.push_front(entry);
        self.size += size;
    }

    fn resize(&mut self, max_size: usize) {
        self.max_size = max_size;
        self.evict_to(max_size);
    }

    fn evict_to(&mut self, limit: usize) {
        while self.size > limit {
            match self.entries.pop_back() {
                Some(entry) => self.size -= entry.size(),
                None => {
                    self.size = 0;
                    return;
                }
            }
        }
    }
}

/// An integer with an N-bit prefix (§5.1), limited to 5 octets as h2 does.
fn decode_int(block: &[u8], pos: &mut usize, prefix: u8) -> Result<usize, DecodeError> {
    let mask = (1u8 << prefix) - 1;
    let first = *block.get(*pos).ok_or(DecodeError::Truncated)?;
    *pos += 1;
    let mut value = usize::from(first & mask);
    if value < usize::from(mask) {
        return Ok(value);
    }
    let mut shift = 0;
    for octets in 2..=5 {
        let byte = *block.get(*pos).ok_or(DecodeError::Truncated)?;
        *pos += 1;
        value += usize::from(byte & 0x7f) << shift;
        shift += 7;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
        if octets == 5 {
            break;
        }
    }
    Err(DecodeError::IntegerTooLong)
}

/// A string literal (§5.2): a raw string is a slice of the block, a Huffman one
/// is decoded into `scratch`.
fn decode_string<'a>(
    block: &'a [u8],
    pos: &mut usize,
    scratch: &'a mut Vec<u8>,
) -> Result<&'a [u8], DecodeError> {
    let huffman = block.get(*pos).ok_or(DecodeError::Truncated)? & 0x80 != 0;
    let len = decode_int(block, pos, 7)?;
    let end = pos
        .checked_add(len)
        .filter(|&end| end <= block.len())
        .ok_or(DecodeError::Truncated)?;
    let raw = &block[*pos..end];
    *pos = end;
    if huffman {
        scratch.clear();
        huffman_decode(raw, scratch)?;
        Ok(scratch)
    } else {
        Ok(raw)
    }
}

// === encoding ===

/// A field's size in a header list or table: name + value + 32 octets (§4.1).
pub fn field_size(name: &[u8], value: &[u8]) -> usize {
    name.len() + value.len() + ENTRY_OVERHEAD
}

/// Appends a literal field without indexing (or never indexed), name and value as
/// raw strings: it leaves the receiver's dynamic table as it was.
pub fn encode_literal(name: &[u8], value: &[u8], indexing: Indexing, dst: &mut BytesMut) {
    dst.reserve(name.len() + value.len() + 11);
    dst.put_u8(match indexing {
        Indexing::Allowed => 0x00,
        Indexing::Never => 0x10,
    });
    encode_string(name, dst);
    encode_string(value, dst);
}

fn encode_string(string: &[u8], dst: &mut BytesMut) {
    // H = 0: raw octets, 7-bit length prefix.
    encode_int(string.len(), 7, 0x00, dst);
    dst.put_slice(string);
}

/// An integer with an N-bit prefix (§5.1), the first octet's other bits set to `flags`.
fn encode_int(mut value: usize, prefix: u8, flags: u8, dst: &mut BytesMut) {
    let mask = (1usize << prefix) - 1;
    if value < mask {
        dst.put_u8(flags | value as u8);
        return;
    }
    dst.put_u8(flags | mask as u8);
    value -= mask;
    while value >= 0x80 {
        dst.put_u8(0x80 | (value & 0x7f) as u8);
        value >>= 7;
    }
    dst.put_u8(value as u8);
}

// === Huffman ===

/// Code length of each symbol, 0..=255 and EOS (256), from RFC 7541 Appendix B.
/// The code is canonical, so the lengths alone define it.
const HUFFMAN_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, //
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28, //
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, //
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, //
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, //
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, //
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, //
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, //
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, //
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, //
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, //
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23, //
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, //
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, //
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, //
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, //
    30,
];

const EOS: u16 = 256;
const MAX_CODE_LEN: usize = 30;

/// The canonical code's decoding tables: per length, how many codes, the first
/// code, and where its symbols start in `symbols` (sorted by length, then value);
/// and for the codes of up to 8 bits (every letter and digit), a table by the 8
/// bits a code starts.
struct Canonical {
    count: [u32; MAX_CODE_LEN + 1],
    first: [u32; MAX_CODE_LEN + 1],
    index: [u32; MAX_CODE_LEN + 1],
    symbols: [u16; 257],
    /// Symbol in bits 0..9 and length in bits 9..13; 0 where the code is longer.
    short: [u16; 256],
}

static CANONICAL: Canonical = canonical();

const fn canonical() -> Canonical {
    let mut count = [0u32; MAX_CODE_LEN + 1];
    let mut symbol = 0;
    while symbol < 257 {
        count[HUFFMAN_LENGTHS[symbol] as usize] += 1;
        symbol += 1;
    }
    let mut first = [0u32; MAX_CODE_LEN + 1];
    let mut index = [0u32; MAX_CODE_LEN + 1];
    let mut code = 0u32;
    let mut at = 0u32;
    let mut len = 1;
    while len <= MAX_CODE_LEN {
        first[len] = code;
        index[len] = at;
        code = (code + count[len]) << 1;
        at += count[len];
        len += 1;
    }
    let mut symbols = [0u16; 257];
    let mut next = index;
    let mut symbol = 0;
    while symbol < 257 {
        let len = HUFFMAN_LENGTHS[symbol] as usize;
        symbols[next[len] as usize] = symbol as u16;
        next[len] += 1;
        symbol += 1;
    }
    let mut short = [0u16; 256];
    let mut len = 1;
    while len <= 8 {
        let mut rank = 0;
        while rank < count[len] {
            let symbol = symbols[(index[len] + rank) as usize];
            let start = ((first[len] + rank) << (8 - len)) as usize;
            let mut fill = 0;
            while fill < 1 << (8 - len) {
                short[start + fill] = (len as u16) << 9 | symbol;
                fill += 1;
            }
            rank += 1;
        }
        len += 1;
    }
    Canonical {
        count,
        first,
        index,
        symbols,
        short,
    }
}

/// Decodes a Huffman-coded string (§5.2) onto `out`: codes of up to 8 bits by
/// table, longer ones length by length on the canonical code.
pub fn huffman_decode(encoded: &[u8], out: &mut Vec<u8>) -> Result<(), DecodeError> {
    // Coded strings are at least 5/8 of the text's length.
    out.reserve(encoded.len() * 8 / 5);
    let mut input = encoded.iter();
    // Bits read and not yet decoded, the oldest first, right-aligned.
    let mut acc = 0u64;
    let mut bits = 0u32;
    loop {
        while bits <= 56 {
            let Some(&byte) = input.next() else { break };
            acc = acc << 8 | u64::from(byte);
            bits += 8;
        }
        if bits == 0 {
            return Ok(());
        }
        let short = if bits >= 8 {
            CANONICAL.short[(acc >> (bits - 8)) as usize & 0xff]
        } else {
            0
        };
        let (symbol, len) = match short {
            0 => match long_code(acc, bits) {
                Some(found) => found,
                // No code in what is left, so it is padding: the most significant
                // bits of EOS, all ones, and under a byte.
                None if bits <= 7 && acc == (1 << bits) - 1 => return Ok(()),
                None => return Err(DecodeError::HuffmanPadding),
            },
            entry => (entry & 0x1ff, u32::from(entry >> 9)),
        };
        if symbol == EOS {
            return Err(DecodeError::HuffmanEos);
        }
        out.push(symbol as u8);
        bits -= len;
        acc &= (1 << bits) - 1;
    }
}

/// The code at the head of the `bits` bits in `acc`, by trying each length.
fn long_code(acc: u64, bits: u32) -> Option<(u16, u32)> {
    for len in 1..=bits.min(MAX_CODE_LEN as u32) {
        let code = (acc >> (bits - len)) as u32;
        let offset = code.wrapping_sub(CANONICAL.first[len as usize]);
        if offset < CANONICAL.count[len as usize] {
            let symbol = CANONICAL.symbols[(CANONICAL.index[len as usize] + offset) as usize];
            return Some((symbol, len));
        }
    }
    None
}

// === static table ===

const STATIC_LEN: usize = 61;

/// RFC 7541 Appendix A.
const STATIC_TABLE: [(&[u8], &[u8]); STATIC_LEN] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;
