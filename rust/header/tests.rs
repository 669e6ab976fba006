//! Tests of header parsing, validation and building: one broken rule per test.

use super::*;

/// A file from a raw JSON header and `data_len` zero bytes of data.
fn file(json: &str, data_len: usize) -> Vec<u8> {
    let mut v = (json.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(json.as_bytes());
    v.extend(std::iter::repeat_n(0u8, data_len));
    v
}

fn rule(buf: &[u8]) -> &'static str {
    parse_buffer(buf).unwrap_err().rule()
}

#[test]
fn accepts_a_valid_file_with_metadata_and_empty_and_scalar_tensors() {
    let json = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"s":{"dtype":"BF16","shape":[],"data_offsets":[16,18]},"e":{"dtype":"I64","shape":[0,3],"data_offsets":[18,18]}}"#;
    let h = parse_buffer(&file(json, 18)).unwrap();
    assert_eq!(h.tensors().len(), 3);
    assert_eq!(h.get("s").unwrap().numel(), 1);
    assert_eq!(h.get("e").unwrap().nbytes(), 0);
    assert_eq!(
        h.metadata().unwrap(),
        &[("format".to_string(), "pt".to_string())]
    );
    assert_eq!(h.sorted_names(), vec!["a", "e", "s"]);
}

#[test]
fn refuses_empty_shapes_that_no_tensor_can_index_and_accepts_the_largest_that_can() {
    let one = |shape: &str| {
        let json = format!(r#"{{"e":{{"dtype":"F32","shape":{shape},"data_offsets":[0,0]}}}}"#);
        parse_buffer(&file(&json, 0)).map(|h| h.tensors().len())
    };
    for shape in [
        "[0,9223372036854775808]",
        "[9223372036854775808,0]",
        "[0,1099511627776,1099511627776]",
        "[0,4611686018427387904,4]",
    ] {
        assert_eq!(one(shape).unwrap_err().rule(), "invalid-shape", "{shape}");
    }
    for shape in [
        "[0,9223372036854775807]",
        "[0,2147483648,2147483648]",
        "[4611686018427387904,0,4]",
        "[0]",
    ] {
        assert_eq!(one(shape).unwrap(), 1, "{shape}");
    }
}

#[test]
fn accepts_an_empty_header() {
    assert!(parse_buffer(&file("{}", 0)).unwrap().tensors().is_empty());
}

#[test]
fn rejects_a_file_shorter_than_the_length_prefix() {
    assert_eq!(rule(&[1, 2, 3]), "file-too-small");
}

#[test]
fn rejects_a_header_length_over_the_cap() {
    let mut v = (MAX_HEADER_LEN + 1).to_le_bytes().to_vec();
    v.extend_from_slice(b"{}");
    assert_eq!(rule(&v), "header-too-large");
    let v = u64::MAX.to_le_bytes().to_vec();
    assert_eq!(rule(&v), "header-too-large");
}

#[test]
fn rejects_a_header_length_past_the_end_of_file() {
    let mut v = 100u64.to_le_bytes().to_vec();
    v.extend_from_slice(b"{}");
    assert_eq!(rule(&v), "header-past-eof");
}

#[test]
fn rejects_a_header_that_is_not_utf8() {
    let mut v = 4u64.to_le_bytes().to_vec();
    v.extend_from_slice(&[b'{', 0xff, 0xfe, b'}']);
    assert_eq!(rule(&v), "header-not-utf8");
}

#[test]
fn rejects_invalid_json() {
    assert_eq!(rule(&file("{\"a\":", 0)), "invalid-json");
    assert_eq!(rule(&file("nope", 0)), "invalid-json");
}

#[test]
fn rejects_json_that_is_not_an_object() {
    assert_eq!(rule(&file("[1,2]", 0)), "header-not-object");
    assert_eq!(rule(&file("  \"x\"", 0)), "header-not-object");
}

#[test]
fn rejects_entries_with_missing_or_mistyped_fields() {
    assert_eq!(
        rule(&file(r#"{"a":{"dtype":"F32","shape":[1]}}"#, 4)),
        "invalid-tensor-entry"
    );
    assert_eq!(rule(&file(r#"{"a":3}"#, 0)), "invalid-tensor-entry");
    assert_eq!(
        rule(&file(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#,
            4
        )),
        "invalid-tensor-entry"
    );
    assert_eq!(
        rule(&file(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,-4]}}"#,
            4
        )),
        "invalid-tensor-entry"
    );
}

#[test]
fn accepts_unknown_entry_fields_and_null_metadata_but_notes_them_for_strict_reading() {
    let h = parse_buffer(&file(
        r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}"#,
        4,
    ))
    .unwrap();
    assert_eq!(h.get("a").unwrap().shape, vec![1]);
    let v = h.strict_violation().unwrap();
    assert_eq!(v.rule(), "invalid-tensor-entry");
    assert!(v.to_string().contains("unknown field 'x'"));

    let h = parse_buffer(&file(r#"{"__metadata__":null}"#, 0)).unwrap();
    assert!(h.metadata().is_none());
    assert_eq!(h.strict_violation().unwrap().rule(), "invalid-metadata");

    let ok = r#"{"__metadata__":{},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    assert!(parse_buffer(&file(ok, 4))
        .unwrap()
        .strict_violation()
        .is_none());
}

#[test]
fn rejects_an_unknown_dtype() {
    assert_eq!(
        rule(&file(
            r#"{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}"#,
            16
        )),
        "unknown-dtype"
    );
}

#[test]
fn rejects_negative_non_integer_and_overflowing_shapes() {
    assert_eq!(
        rule(&file(
            r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            4
        )),
        "invalid-shape"
    );
    assert_eq!(
        rule(&file(
            r#"{"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}"#,
            4
        )),
        "invalid-shape"
    );
    let big = r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,4]}}"#;
    assert_eq!(rule(&file(big, 4)), "invalid-shape");
    assert_eq!(
        rule(&file(
            r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#,
            2
        )),
        "invalid-shape"
    );
}

#[test]
fn rejects_begin_after_end() {
    assert_eq!(
        rule(&file(
            r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#,
            4
        )),
        "invalid-offsets"
    );
}

#[test]
fn rejects_a_span_that_disagrees_with_the_shape() {
    assert_eq!(
        rule(&file(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
            4
        )),
        "span-mismatch"
    );
}

#[test]
fn rejects_offsets_past_the_end_of_the_data() {
    assert_eq!(
        rule(&file(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            4
        )),
        "offsets-past-eof"
    );
}

#[test]
fn rejects_duplicate_names() {
    let json = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
    assert_eq!(rule(&file(json, 2)), "duplicate-name");
}

#[test]
fn rejects_overlapping_tensors() {
    let json = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
    assert_eq!(rule(&file(json, 6)), "overlap");
}

#[test]
fn rejects_a_hole_between_tensors_or_before_the_first() {
    let json = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#;
    assert_eq!(rule(&file(json, 6)), "gap");
    assert_eq!(
        rule(&file(
            r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#,
            4
        )),
        "gap"
    );
}

#[test]
fn rejects_trailing_bytes_after_the_last_tensor() {
    assert_eq!(
        rule(&file(
            r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
            5
        )),
        "trailing-bytes"
    );
}

#[test]
fn rejects_metadata_that_is_not_string_to_string() {
    assert_eq!(
        rule(&file(r#"{"__metadata__":{"a":1}}"#, 0)),
        "invalid-metadata"
    );
    assert_eq!(rule(&file(r#"{"__metadata__":[]}"#, 0)), "invalid-metadata");
}

#[test]
fn rejects_a_field_or_metadata_key_given_twice() {
    // Readers disagree on which duplicate wins, so neither may.
    let twice = r#"{"a":{"dtype":"F32","dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
    let err = parse_buffer(&file(twice, 4)).unwrap_err();
    assert_eq!(err.rule(), "invalid-tensor-entry");
    assert!(err.to_string().contains("'dtype' appears twice"), "{err}");
    let meta = r#"{"__metadata__":{"format":"pt","format":"np"}}"#;
    assert_eq!(rule(&file(meta, 0)), "invalid-metadata");
}

#[test]
fn metadata_is_sorted_by_key_whatever_the_file_order() {
    let h = parse_buffer(&file(r#"{"__metadata__":{"b":"2","a":"1"}}"#, 0)).unwrap();
    let keys: Vec<&str> = h
        .metadata()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str())
        .collect();
    assert_eq!(keys, ["a", "b"]);
}

#[test]
fn built_headers_parse_back() {
    let tensors = vec![
        ("w".to_string(), Dtype::F32, vec![3, 2]),
        ("b".to_string(), Dtype::BF16, vec![]),
        ("e".to_string(), Dtype::I8, vec![0]),
    ];
    let meta = [("format".to_string(), "pt".to_string())];
    let (prefix, offsets) = build_header(&tensors, Some(&meta)).unwrap();
    assert_eq!(prefix.len() % 8, 0);
    let data_len = offsets.last().unwrap().1 as usize;
    let mut buf = prefix.clone();
    buf.extend(std::iter::repeat_n(0u8, data_len));
    let h = parse_buffer(&buf).unwrap();
    assert_eq!(h.get("w").unwrap().begin, 0);
    assert_eq!(h.get("b").unwrap().end, 26);
    assert!(build_header(&[tensors[0].clone(), tensors[0].clone()], None).is_err());
}

#[test]
fn built_headers_are_byte_identical_to_the_safetensors_writer() {
    let tensors = vec![("test1".to_string(), Dtype::I32, vec![2, 2])];
    let meta = [("framework".to_string(), "pt".to_string())];
    let (prefix, _) = build_header(&tensors, Some(&meta)).unwrap();
    let json = r#"{"__metadata__":{"framework":"pt"},"test1":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}"#;
    assert_eq!(&prefix[..8], &96u64.to_le_bytes());
    assert_eq!(
        std::str::from_utf8(&prefix[8..]).unwrap(),
        format!("{json} ")
    );
}
