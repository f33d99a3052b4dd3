/* Strings from outside (a server's answers, a file's names and metadata) on their way to a terminal.
 *
 * A server or a file can hold any bytes, and a terminal acts on some of them: ESC [2J clears the
 * screen, ESC ] 52 writes the clipboard, a newline starts a line that looks like our own ("step 42").
 * Every such string the client prints passes through here first.  Its shown form keeps valid UTF-8
 * as it is, except control characters: C0 (U+0000..U+001F, newline and tab included), DEL and C1
 * (U+0080..U+009F, which terminals read as ESC sequences too) are written as \u00XX, and a byte that is
 * not part of valid UTF-8 (a raw C1 byte among them) as \xXX.
 *
 * Why \u00XX and not \x1b: the same text also prints JSON (status --json, push's answer, inspect
 * --json), and a \u00XX inside a JSON string is that JSON's own escape of the same character, so valid
 * JSON stays valid and means the same.  For the same reason a backslash is kept as it is. */
#ifndef CLI_UNTRUSTED_H
#define CLI_UNTRUSTED_H

#include <stddef.h>
#include <stdio.h>

#include "strbuf.h"

/* The longest shown form of one character ("\u009f", "\x9b", or 4 bytes of UTF-8), without NUL. */
#define CLI_UNTRUSTED_UNIT_MAX 6

/* Appends the shown form of s[0..len) to b (b->oom on allocation failure, as sb_add). */
void cli_untrusted_append(sbuf *b, const char *s, size_t len);

/* The shown form of s[0..len) in out (size bytes, always NUL-terminated when size > 0), cut before a
 * whole character with "..." when it does not fit.  Returns out, for a printf argument. */
const char *cli_untrusted(char *out, size_t size, const char *s, size_t len);

/* cli_untrusted for a C string; NULL shows as "-". */
const char *cli_untrusted_str(char *out, size_t size, const char *s);

/* Writes the shown form of s[0..len) to f, all of it.  0, or -EIO when f failed. */
int cli_print_untrusted(FILE *f, const char *s, size_t len);

#endif
