use bytes::{BufMut, BytesMut};
use proptest::prelude::*;

use super::testing::*;
use super::*;

fn hex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text
        .bytes()
        .filter(u8::is_ascii_hexdigit)
        .map(|d| (d as char).to_digit(16).expect("hex digit") as u8)
        .collect();
    digits.chunks(2).map(|p| p[0] << 4 | p[1]).collect()
}

fn decode(decoder: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, DecodeError> {
    Ok(decode_all(decoder, block)?
        .into_iter()
        .map(|(name, value, _)| {
            (
                String::from_utf8(name).expect("utf-8"),
                String::from_utf8(value).expect("utf-8"),
            )
        })
        .collect())
}

fn pairs(fields: &[(&str, &str)]) -> Vec<(String, String)> {
    fields
        .iter()
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect()
}

fn table(decoder: &Decoder) -> (Vec<(String, String)>, usize) {
    let entries = decoder
        .table
        .entries
        .iter()
        .map(|entry| {
            let (n, v) = entry.split();
            (
                String::from_utf8_lossy(n).into_owned(),
                String::from_utf8_lossy(v).into_owned(),
            )
        })
        .collect();
    (entries, decoder.table.size)
}

// === RFC 7541 Appendix C ===

#[test]
fn rfc_c2_single_fields() {
    // C.2.1: literal with indexing, new name.
    let mut decoder = Decoder::new(4096);
    let block = hex("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572");
    assert_eq!(
        decode(&mut decoder, &block),
        Ok(pairs(&[("custom-key", "custom-header")]))
    );
    assert_eq!(table(&decoder).1, 55);
    // C.2.2: literal without indexing, indexed name.
    let mut decoder = Decoder::new(4096);
    let block = hex("040c 2f73 616d 706c 652f 7061 7468");
    assert_eq!(
        decode(&mut decoder, &block),
        Ok(pairs(&[(":path", "/sample/path")]))
    );
    assert_eq!(table(&decoder).1, 0);
    // C.2.3: never indexed, new name.
    let mut decoder = Decoder::new(4096);
    let block = hex("1008 7061 7373 776f 7264 0673 6563 7265 74");
    assert_eq!(
        decode_all(&mut decoder, &block),
        Ok(vec![(
            b"password".to_vec(),
            b"secret".to_vec(),
            Indexing::Never
        )])
    );
    // C.2.4: indexed.
    let mut decoder = Decoder::new(4096);
    assert_eq!(
        decode(&mut decoder, &hex("82")),
        Ok(pairs(&[(":method", "GET")]))
    );
}

const C3: [&str; 3] = [
    "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
    "8286 84be 5808 6e6f 2d63 6163 6865",
    "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
];

const C4: [&str; 3] = [
    "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
    "8286 84be 5886 a8eb 1064 9cbf",
    "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
];

fn check_requests(blocks: [&str; 3]) {
    let mut decoder = Decoder::new(4096);
    let expected = [
        pairs(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
        ]),
        pairs(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
            ("cache-control", "no-cache"),
        ]),
        pairs(&[
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/index.html"),
            (":authority", "www.example.com"),
            ("custom-key", "custom-value"),
        ]),
    ];
    let sizes = [57, 110, 164];
    for ((block, expected), size) in blocks.iter().zip(expected).zip(sizes) {
        assert_eq!(decode(&mut decoder, &hex(block)), Ok(expected));
        assert_eq!(table(&decoder).1, size);
    }
    assert_eq!(
        table(&decoder).0,
        pairs(&[
            ("custom-key", "custom-value"),
            ("cache-control", "no-cache"),
            (":authority", "www.example.com"),
        ])
    );
}

#[test]
fn rfc_c3_requests_without_huffman() {
    check_requests(C3);
}

#[test]
fn rfc_c4_requests_with_huffman() {
    check_requests(C4);
}

const C5: [&str; 3] = [
    "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 \
     2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 \
     6c65 2e63 6f6d",
    "4803 3330 37c1 c0bf",
    "88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d \
     54c0 5a04 677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049 \
     5541 5851 5745 4f49 553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e \
     3d31",
];

const C6: [&str; 3] = [
    "4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6 \
     2d1b ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3",
    "4883 640e ffc1 c0bf",
    "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab \
     77ad 94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f \
     9587 3160 65c0 03ed 4ee5 b106 3d50 07",
];

/// Responses with a 256-octet table: entries are evicted.
fn check_responses(blocks: [&str; 3]) {
    let mut decoder = Decoder::new(256);
    let date = "Mon, 21 Oct 2013 20:13:21 GMT";
    let location = "https://www.example.com";
    let cookie = "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1";
    let expected = [
        pairs(&[
            (":status", "302"),
            ("cache-control", "private"),
            ("date", date),
            ("location", location),
        ]),
        pairs(&[
            (":status", "307"),
            ("cache-control", "private"),
            ("date", date),
            ("location", location),
        ]),
        pairs(&[
            (":status", "200"),
            ("cache-control", "private"),
            ("date", "Mon, 21 Oct 2013 20:13:22 GMT"),
            ("location", location),
            ("content-encoding", "gzip"),
            ("set-cookie", cookie),
        ]),
    ];
    let sizes = [222, 222, 215];
    for ((block, expected), size) in blocks.iter().zip(expected).zip(sizes) {
        assert_eq!(decode(&mut decoder, &hex(block)), Ok(expected));
        assert_eq!(table(&decoder).1, size);
    }
    assert_eq!(
        table(&decoder).0,
        pairs(&[
            ("set-cookie", cookie),
            ("content-encoding", "gzip"),
            ("date", "Mon, 21 Oct 2013 20:13:22 GMT"),
        ])
    );
}

#[test]
fn rfc_c5_responses_without_huffman() {
    check_responses(C5);
}

#[test]
fn rfc_c6_responses_with_huffman() {
    check_responses(C6);
}

// === Huffman ===

#[test]
fn huffman_code_matches_rfc_appendix_b() {
    let codes = huffman_codes();
    // A few entries of the RFC's table, each length class.
    assert_eq!(codes[usize::from(b'0')], (0x0, 5));
    assert_eq!(codes[usize::from(b'a')], (0x3, 5));
    assert_eq!(codes[usize::from(b' ')], (0x14, 6));
    assert_eq!(codes[usize::from(b'/')], (0x18, 6));
    assert_eq!(codes[usize::from(b'%')], (0x15, 6));
    assert_eq!(codes[0], (0x1ff8, 13));
    assert_eq!(codes[255], (0x3ffffee, 26));
    assert_eq!(codes[256], (0x3fff_ffff, 30));
    // Complete: the lengths fill the code space exactly (Kraft equality).
    let kraft: u64 = HUFFMAN_LENGTHS.iter().map(|&l| 1u64 << (30 - l)).sum();
    assert_eq!(kraft, 1 << 30);
}

fn huffman(encoded: &[u8]) -> Result<Vec<u8>, DecodeError> {
    let mut out = Vec::new();
    huffman_decode(encoded, &mut out).map(|()| out)
}

#[test]
fn huffman_every_symbol_round_trips() {
    for byte in 0..=255u8 {
        let text = [byte, b'a', byte, byte];
        assert_eq!(huffman(&huffman_encode(&text)), Ok(text.to_vec()));
    }
    assert_eq!(huffman(&[]), Ok(Vec::new()));
}

#[test]
fn huffman_refuses_eos_and_bad_padding() {
    // EOS spelled out: 30 ones, then padding.
    assert_eq!(
        huffman(&[0xff, 0xff, 0xff, 0xff]),
        Err(DecodeError::HuffmanEos)
    );
    // 'a' (00011) then padding of zeros instead of ones.
    assert_eq!(huffman(&[0b0001_1000]), Err(DecodeError::HuffmanPadding));
    // A whole byte of padding after a full byte of symbols.
    let mut two_a = huffman_encode(b"a0");
    assert_eq!(two_a.len(), 2);
    two_a.push(0xff);
    assert_eq!(huffman(&two_a), Err(DecodeError::HuffmanPadding));
}

// === errors ===

#[test]
fn malformed_blocks_are_refused() {
    let cases: &[(&[u8], DecodeError)] = &[
        (&[0x80], DecodeError::IndexZero),
        (
            &[0x80 | 62],
            DecodeError::IndexPastTable { index: 62, len: 61 },
        ),
        (
            &[0x40 | 63, 0x00],
            DecodeError::IndexPastTable { index: 63, len: 61 },
        ),
        (&[0x41], DecodeError::Truncated),
        (&[0x00, 0x03, b'a'], DecodeError::Truncated),
        (&[0x00, 0x01, b'a'], DecodeError::Truncated),
        (&[0x00], DecodeError::Truncated),
        (&[0xff], DecodeError::Truncated),
        (&[0xff, 0x80, 0x80, 0x80, 0x80], DecodeError::IntegerTooLong),
        (
            &[0x3f, 0xe2, 0x1f],
            DecodeError::TableSizeTooLarge {
                size: 4097,
                max: 4096,
            },
        ),
        (&[0x82, 0x20], DecodeError::TableSizeUpdateLate),
        (&[0x00, 0x81, 0xff, 0x00], DecodeError::HuffmanPadding),
    ];
    for (block, error) in cases {
        let mut decoder = Decoder::new(4096);
        assert_eq!(
            decode_all(&mut decoder, block).map(|_| ()),
            Err(*error),
            "{block:02x?}"
        );
    }
}

// === the table ===

#[test]
fn size_updates_evict_and_oversize_entries_empty_the_table() {
    let mut decoder = Decoder::new(4096);
    decode(&mut decoder, &hex(C3[0])).expect("decodes");
    decode(&mut decoder, &hex(C3[1])).expect("decodes");
    assert_eq!(table(&decoder).0.len(), 2);
    // Size update to 60: only the newest entry (53 octets) fits.
    decode(&mut decoder, &[0x3f, 0x1d]).expect("decodes");
    assert_eq!(
        table(&decoder),
        (pairs(&[("cache-control", "no-cache")]), 53)
    );
    // An entry over the table's size empties it.
    let mut block = BytesMut::new();
    block.put_u8(0x40);
    encode_string(b"x-big", &mut block);
    encode_string(&[b'v'; 40], &mut block);
    decode(&mut decoder, &block).expect("decodes");
    assert_eq!(table(&decoder), (Vec::new(), 0));
    // Back up to 4096, then index 62 names nothing.
    assert_eq!(
        decode_all(&mut decoder, &hex("3fe1 1fbe")).map(|_| ()),
        Err(DecodeError::IndexPastTable { index: 62, len: 61 })
    );
}

// === properties ===

fn field() -> impl Strategy<Value = (Vec<u8>, Vec<u8>, Representation, bool)> {
    (
        prop_oneof![
            Just(b":authority".to_vec()),
            Just(b"grpc-timeout".to_vec()),
            "[a-z-]{1,12}".prop_map(String::into_bytes),
        ],
        prop_oneof![
            Just(b"/var/run/containerd/containerd.sock".to_vec()),
            proptest::collection::vec(any::<u8>(), 0..40),
        ],
        representation(),
        any::<bool>(),
    )
}

proptest! {
    #[test]
    fn huffman_round_trips_any_text(text in proptest::collection::vec(any::<u8>(), 0..200)) {
        prop_assert_eq!(huffman(&huffman_encode(&text)), Ok(text));
    }

    #[test]
    fn huffman_takes_any_bytes_without_panic(coded in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = huffman(&coded);
    }

    #[test]
    fn arbitrary_bytes_never_panic(blocks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 1..6)) {
        let mut decoder = Decoder::new(4096);
        for block in blocks {
            let _ = decoder.decode(&block, |_, _, _| {});
        }
    }

    #[test]
    fn what_an_encoder_writes_decodes_to_what_it_was_given(
        blocks in proptest::collection::vec(
            (proptest::collection::vec(field(), 0..8), proptest::option::of(0usize..=4096)),
            1..8,
        ),
    ) {
        let mut encoder = TestEncoder { table: Vec::new(), size: 0, max: 4096 };
        let mut decoder = Decoder::new(4096);
        for (fields, resize) in blocks {
            let mut block = BytesMut::new();
            encoder.encode(&fields, resize, &mut block);
            let decoded = decode_all(&mut decoder, &block);
            let sent: Vec<_> = fields
                .into_iter()
                .map(|(n, v, r, _)| {
                    let indexing = match r {
                        Representation::NeverIndexed => Indexing::Never,
                        _ => Indexing::Allowed,
                    };
                    (n, v, indexing)
                })
                .collect();
            let decoded = decoded.expect("decodes");
            prop_assert_eq!(decoded, sent);
            prop_assert_eq!(decoder.table.size, encoder.size);
        }
    }
}
