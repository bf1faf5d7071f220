// Validate AsyncAPI documents with the official parser (@asyncapi/parser): the JSON Schema of the
// spec version, then the parser's own rules (Spectral ruleset: references resolve, ids unique...).
// Usage: node validate.mjs FILE...   Prints, per file, one JSON line
//   {"file": ..., "errors": [...], "warnings": [...], "version": "3.0.0", "channels": N, "operations": N}
// and exits 1 when a document has an error (a diagnostic of severity 0).
import { readFileSync } from "node:fs";
import { Parser } from "@asyncapi/parser";

const parser = new Parser();
let failed = false;
for (const file of process.argv.slice(2)) {
  const { document, diagnostics } = await parser.parse(readFileSync(file, "utf8"), { source: file });
  const show = (d) => ({ code: d.code, message: d.message, path: d.path.join(".") });
  const errors = diagnostics.filter((d) => d.severity === 0).map(show);
  const warnings = diagnostics.filter((d) => d.severity > 0).map(show);
  if (errors.length || !document) failed = true;
  console.log(JSON.stringify({
    file,
    errors,
    warnings,
    version: document ? document.version() : null,
    channels: document ? document.channels().length : 0,
    operations: document ? document.operations().length : 0,
  }));
}
process.exit(failed ? 1 : 0);
