//! Filter's and prioritize's arguments read fast: kube-scheduler sends the pod
//! and thousands of node names, and serde_json spends most of a call's time on
//! the names, one string at a time (UTF-8 check, escapes, visitor). Here the
//! body's UTF-8 is checked once and each name is a slice of it. Only the usual
//! shape is read so ([`usual_args`]); anything else, or any doubt, goes to
//! serde_json, which then answers as it always did (its errors included).

use std::borrow::Cow;

use k8s_openapi::api::core::v1::Pod;

use super::{ExtenderArgsIn, Name};

/// The arguments of filter or prioritize: by [`usual_args`] when the body has the
/// usual shape, else by serde_json.
pub(crate) fn read_args(body: &[u8]) -> serde_json::Result<ExtenderArgsIn<'_>> {
    match usual_args(body) {
        Some((pod, names)) => Ok(ExtenderArgsIn {
            pod,
            nodes: None,
            node_names: Some(names),
        }),
        None => serde_json::from_slice(body),
    }
}

/// `{"Pod": …, "NodeNames": ["…", …]}` in any order and spacing, with
/// `"Nodes": null` or not: the pod (read by serde_json) and the names, each a
/// slice of `body`. `None` for any other shape: another or a repeated key, a name
/// with an escape or a control character, text after the object, a pod
/// serde_json refuses; serde_json then reads the body (and says what is wrong).
pub(crate) fn usual_args(body: &[u8]) -> Option<(Pod, Vec<Name<'_>>)> {
    let text = std::str::from_utf8(body).ok()?;
    let mut at = Cursor { text, at: 0 };
    let (mut pod, mut names, mut nodes) = (None, None, false);
    at.expect(b'{')?;
    loop {
        let key = at.plain_string()?;
        at.expect(b':')?;
        match key {
            "Pod" if pod.is_none() => {
                let start = at.skip_space();
                let end = skip_value(body, start)?;
                pod = Some(serde_json::from_str::<Pod>(text.get(start..end)?).ok()?);
                at.at = end;
            }
            "NodeNames" if names.is_none() => names = Some(at.names()?),
            "Nodes" if !nodes => {
                at.skip_space();
                at.literal("null")?;
                nodes = true;
            }
            _ => return None,
        }
        match at.next_byte()? {
            b',' => continue,
            b'}' => break,
            _ => return None,
        }
    }
    // Nothing but spacing after the object, as serde_json requires.
    (at.skip_space() == body.len()).then_some(())?;
    Some((pod?, names?))
}

/// A position in the body's text.
struct Cursor<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Cursor<'a> {
    /// Past JSON's spacing; returns where it stops.
    fn skip_space(&mut self) -> usize {
        let bytes = self.text.as_bytes();
        while bytes
            .get(self.at)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            self.at += 1;
        }
        self.at
    }

    /// The next byte after spacing, taken.
    fn next_byte(&mut self) -> Option<u8> {
        self.skip_space();
        let byte = *self.text.as_bytes().get(self.at)?;
        self.at += 1;
        Some(byte)
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        (self.next_byte()? == byte).then_some(())
    }

    fn literal(&mut self, word: &str) -> Option<()> {
        let rest = self.text.get(self.at..)?;
        rest.starts_with(word).then_some(())?;
        self.at += word.len();
        Some(())
    }

    /// A string with no escape and no control character, as a slice of the text
    /// (its quotes are ASCII, so the slice falls on character boundaries).
    fn plain_string(&mut self) -> Option<&'a str> {
        self.expect(b'"')?;
        let start = self.at;
        let bytes = self.text.as_bytes();
        let end = start + plain_prefix(bytes.get(start..)?);
        (bytes.get(end) == Some(&b'"')).then_some(())?;
        self.at = end + 1;
        self.text.get(start..end)
    }

    /// An array of plain strings ([`Cursor::plain_string`]).
    fn names(&mut self) -> Option<Vec<Name<'a>>> {
        self.expect(b'[')?;
        // About one name per 16 bytes left: grown rarely, not by doubling from one.
        let mut names = Vec::with_capacity(self.text.len().saturating_sub(self.at) / 16);
        self.skip_space();
        if self.text.as_bytes().get(self.at) == Some(&b']') {
            self.at += 1;
            return Some(names);
        }
        loop {
            names.push(Name(Cow::Borrowed(self.plain_string()?)));
            match self.next_byte()? {
                b',' => continue,
                b']' => return Some(names),
                _ => return None,
            }
        }
    }
}

/// Where the JSON value starting at `start` ends: strings (escapes skipped),
/// objects and arrays to their closing bracket, other values to the next
/// delimiter. It need not check the value: serde_json reads it next and refuses
/// what is not JSON.
fn skip_value(bytes: &[u8], start: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut at = start;
    loop {
        match *bytes.get(at)? {
            b'"' => {
                at += 1;
                loop {
                    match *bytes.get(at)? {
                        b'"' => break,
                        b'\\' => at += 2,
                        _ => at += 1,
                    }
                }
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.checked_sub(1)?,
            b',' | b' ' | b'\t' | b'\n' | b'\r' if depth == 0 => return Some(at),
            _ => {}
        }
        at += 1;
        if depth == 0 && matches!(bytes.get(at), None | Some(b',' | b'}' | b']')) {
            // A scalar, string or container just ended at the top.
            return Some(at);
        }
    }
}

/// How many bytes at the start of `bytes` a JSON string holds as they are: up to
/// the first `"`, `\\` or control character (or all). Eight bytes at a time: it
/// runs over every node name of a call, read and written.
pub(crate) fn plain_prefix(bytes: &[u8]) -> usize {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    let mut chunks = bytes.chunks_exact(8);
    let mut clean = 0;
    for chunk in chunks.by_ref() {
        let mut word = [0; 8];
        word.copy_from_slice(chunk);
        let x = u64::from_ne_bytes(word);
        // A byte's high bit set where it is 0 (after the xor: a quote or a
        // backslash), or below 0x20: the usual "has zero byte" test, which never
        // misses one. A flagged chunk is looked at byte by byte below.
        let zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
        let quote = zero(x ^ u64::from_ne_bytes([b'"'; 8]));
        let backslash = zero(x ^ u64::from_ne_bytes([b'\\'; 8]));
        let control = x.wrapping_sub(u64::from_ne_bytes([0x20; 8])) & !x & HIGH;
        if quote | backslash | control != 0 {
            break;
        }
        clean += 8;
    }
    clean
        + bytes[clean..]
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
            .unwrap_or(bytes.len() - clean)
}
