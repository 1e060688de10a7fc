#!/usr/bin/env python3
"""Generates src/tokenizer/unicode_data.cpp from the Unicode Character Database.

The tokenizer needs four facts per code point, and nothing else from Unicode:
  * the general category (the Qwen2 pre-tokenizer regex uses \\p{L} and \\p{N});
  * the canonical combining class, the canonical decomposition and the composition exclusions
    (NFC normalization);
  * NFC_Quick_Check (so text that is already NFC, almost all of it, skips the normalizer).

The source files come from Debian's `unicode-data` package (apt-get install -y unicode-data),
which installs them under /usr/share/unicode. The generated .cpp is committed, so building moebius
needs neither this script nor that package; rerun it only to move to a newer Unicode version:

  python3 tools/unicode/gen_unicode_tables.py [--ucd /usr/share/unicode] \\
      [--out src/tokenizer/unicode_data.cpp]

The output depends only on the input files (no dates, no paths), so rerunning it on the same UCD
version reproduces the committed file byte for byte.
"""

import argparse
import os
import re
import sys

# Order of moebius::unicode::GeneralCategory in src/tokenizer/unicode.h. The generated table
# names the enumerators, so a mismatch fails to compile instead of silently mislabelling.
# [TAG_UNICODE_GENERAL_CATEGORY]
CATEGORIES = [
    "Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps", "Pe",
    "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co",
]


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                yield line


def parse_range(text):
    text = text.strip()
    if ".." in text:
        a, b = text.split("..")
        return int(a, 16), int(b, 16)
    return int(text, 16), int(text, 16)


def parse_unicode_data(path):
    """Returns {cp: (gc, ccc, decomposition-or-None)}; ranges given as <..., First>/<..., Last>
    pairs are expanded into (first, last, gc, ccc) entries kept apart to keep memory small."""
    points = {}
    ranges = []
    pending_first = None
    for line in read_lines(path):
        fields = line.split(";")
        cp = int(fields[0], 16)
        name, gc, ccc, decomp = fields[1], fields[2], int(fields[3]), fields[5]
        if name.endswith(", First>"):
            pending_first = cp
            continue
        if name.endswith(", Last>"):
            ranges.append((pending_first, cp, gc, ccc))
            pending_first = None
            continue
        canonical = None
        if decomp and not decomp.startswith("<"):  # "<compat>" etc. are compatibility mappings
            canonical = [int(x, 16) for x in decomp.split()]
        points[cp] = (gc, ccc, canonical)
    return points, ranges


def merged_ranges(values):
    """values: sorted list of (cp, value). Merges consecutive code points with equal values."""
    out = []
    for cp, v in values:
        if out and out[-1][1] == cp - 1 and out[-1][2] == v:
            out[-1][1] = cp
        else:
            out.append([cp, cp, v])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ucd", default="/usr/share/unicode", help="directory with UnicodeData.txt etc.")
    ap.add_argument("--out", default=os.path.normpath(os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "tokenizer", "unicode_data.cpp")))
    args = ap.parse_args()

    ucd = args.ucd
    for name in ("UnicodeData.txt", "DerivedNormalizationProps.txt"):
        if not os.path.exists(os.path.join(ucd, name)):
            sys.exit(f"gen_unicode_tables: {os.path.join(ucd, name)} not found; "
                     "install Debian's unicode-data package (apt-get install -y unicode-data)")

    # The first line of every UCD data file names its version, e.g. "# UnicodeData-15.0.0.txt"
    # is absent from UnicodeData.txt itself but present here.
    version = "unknown"
    with open(os.path.join(ucd, "DerivedNormalizationProps.txt"), encoding="utf-8") as f:
        m = re.search(r"DerivedNormalizationProps-(\d+\.\d+\.\d+)\.txt", f.readline())
        if m:
            version = m.group(1)

    points, big_ranges = parse_unicode_data(os.path.join(ucd, "UnicodeData.txt"))

    # --- general category and combining class per code point -----------------------------------
    gc_values = []
    ccc_values = []
    for cp in sorted(points):
        gc, ccc, _ = points[cp]
        gc_values.append((cp, gc))
        if ccc:
            ccc_values.append((cp, ccc))
    gc_ranges = merged_ranges(gc_values)
    for first, last, gc, ccc in big_ranges:
        assert ccc == 0
        gc_ranges.append([first, last, gc])
    gc_ranges.sort()
    # Merge again across the inserted big ranges.
    merged = []
    for r in gc_ranges:
        if merged and merged[-1][1] + 1 == r[0] and merged[-1][2] == r[2]:
            merged[-1][1] = r[1]
        else:
            merged.append(r)
    gc_ranges = merged
    for a, b in zip(gc_ranges, gc_ranges[1:]):
        assert a[1] < b[0], "overlapping category ranges"
    for r in gc_ranges:
        assert r[2] in CATEGORIES and r[2] != "Cn", r
    ccc_ranges = merged_ranges(ccc_values)

    # --- normalization properties ----------------------------------------------------------------
    exclusions = set()
    nfc_qc = []  # (cp, 'N' | 'M')
    for line in read_lines(os.path.join(ucd, "DerivedNormalizationProps.txt")):
        fields = [f.strip() for f in line.split(";")]
        first, last = parse_range(fields[0])
        if fields[1] == "Full_Composition_Exclusion":
            exclusions.update(range(first, last + 1))
        elif fields[1] == "NFC_QC":
            for cp in range(first, last + 1):
                nfc_qc.append((cp, fields[2]))
    nfc_qc.sort()
    qc_ranges = merged_ranges(nfc_qc)

    decomps = []
    for cp in sorted(points):
        d = points[cp][2]
        if d is None:
            continue
        assert 1 <= len(d) <= 2, (hex(cp), d)  # canonical mappings have one or two code points
        # A singleton decomposition never recomposes; neither does one whose first character is
        # not a starter. Both are in Full_Composition_Exclusion already; check that we agree.
        if len(d) == 1 or points.get(d[0], ("", 0, None))[1] != 0:
            assert cp in exclusions, hex(cp)
        decomps.append((cp, d[0], d[1] if len(d) == 2 else 0, 1 if cp in exclusions else 0))

    # --- write ------------------------------------------------------------------------------------
    out = []
    w = out.append
    w("// GENERATED by tools/unicode/gen_unicode_tables.py from the Unicode Character Database")
    w(f"// {version} (Debian's unicode-data package). Do not edit by hand; rerun the script.")
    w("// Each table is sorted by code point and searched by binary search (unicode.cpp).")
    w('#include "tokenizer/unicode.h"')
    w("")
    w("namespace moebius::unicode::tables {")
    w("namespace {")
    w("using enum GeneralCategory;")
    w("")
    w(f"// General_Category of every assigned code point; gaps are Cn (unassigned). {len(gc_ranges)} ranges.")
    w("constexpr CategoryRange kCategory[] = {")
    for first, last, gc in gc_ranges:
        w(f"    {{0x{first:04X}, 0x{last:04X}, {gc}}},")
    w("};")
    w("")
    w(f"// Canonical_Combining_Class where it is not 0. {len(ccc_ranges)} ranges.")
    w("constexpr ValueRange kCombiningClass[] = {")
    for first, last, ccc in ccc_ranges:
        w(f"    {{0x{first:04X}, 0x{last:04X}, {ccc}}},")
    w("};")
    w("")
    w("// NFC_Quick_Check values other than Yes: 1 = No, 2 = Maybe.")
    w("constexpr ValueRange kNfcQuickCheck[] = {")
    for first, last, v in qc_ranges:
        w(f"    {{0x{first:04X}, 0x{last:04X}, {1 if v == 'N' else 2}}},")
    w("};")
    w("")
    w("// Canonical decompositions (one level; apply recursively) with the Full_Composition_Exclusion")
    w(f"// flag. Hangul syllables are algorithmic and not listed. {len(decomps)} entries.")
    w("constexpr Decomposition kDecomposition[] = {")
    for cp, a, b, ex in decomps:
        w(f"    {{0x{cp:04X}, 0x{a:04X}, 0x{b:04X}, {ex}}},")
    w("};")
    w("")
    w("}  // namespace")
    w("")
    w(f'const char* const kUnicodeVersion = "{version}";')
    w("std::span<const CategoryRange> category_ranges() { return kCategory; }")
    w("std::span<const ValueRange> combining_class_ranges() { return kCombiningClass; }")
    w("std::span<const ValueRange> nfc_quick_check_ranges() { return kNfcQuickCheck; }")
    w("std::span<const Decomposition> decompositions() { return kDecomposition; }")
    w("")
    w("}  // namespace moebius::unicode::tables")
    text = "\n".join(out) + "\n"
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"gen_unicode_tables: Unicode {version}: {len(gc_ranges)} category ranges, "
          f"{len(ccc_ranges)} ccc ranges, {len(qc_ranges)} NFC_QC ranges, {len(decomps)} decompositions "
          f"-> {args.out}")


if __name__ == "__main__":
    main()
