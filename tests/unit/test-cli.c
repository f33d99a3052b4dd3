/* The client's pieces that see a server's bytes: the shown form of outside strings (cli_untrusted)
 * and a model's body taken up to the size its header declares (cli_body). */
#include "test.h"

#include <stdlib.h>

#include "cli_body.h"
#include "cli_untrusted.h"

static const char *shown(const char *s, size_t len)
{
    static char out[1024];
    return cli_untrusted(out, sizeof(out), s, len);
}

#define SHOWN(lit) shown(lit, sizeof(lit) - 1)

TEST(cli_untrusted_escapes_every_control_and_keeps_utf8)
{
    /* C0 (ESC, newline, tab, NUL), DEL, and C1 as UTF-8 (U+009B CSI, U+0085 NEL) */
    CHECK_STR(SHOWN("a\x1b[2J\n\tb"), "a\\u001b[2J\\u000a\\u0009b");
    CHECK_STR(SHOWN("a\0b\x7f"), "a\\u0000b\\u007f");
    CHECK_STR(SHOWN("\xc2\x9b" "31m\xc2\x85" "x"), "\\u009b31m\\u0085x");
    CHECK_STR(SHOWN("\x1b]52;c;ZXZpbA==\x07"), "\\u001b]52;c;ZXZpbA==\\u0007");
    /* the edges of C1: U+007E and U+00A0 are characters */
    CHECK_STR(SHOWN("~\xc2\x80\xc2\x9f\xc2\xa0"), "~\\u0080\\u009f\xc2\xa0");
    /* valid UTF-8 kept, a backslash and a quote too (the text may be JSON) */
    CHECK_STR(SHOWN("\xc3\xa9 \xe4\xb8\xad \xf0\x9f\x98\x80 \\ \""), "\xc3\xa9 \xe4\xb8\xad \xf0\x9f\x98\x80 \\ \"");
}

TEST(cli_untrusted_escapes_each_byte_that_is_not_utf8)
{
    CHECK_STR(SHOWN("\x9b" "2J"), "\\x9b2J");                          /* a raw 8-bit CSI */
    CHECK_STR(SHOWN("\xff\xfe"), "\\xff\\xfe");
    CHECK_STR(SHOWN("\xe2\x82 x"), "\\xe2\\x82 x");                    /* a sequence cut short */
    CHECK_STR(SHOWN("\xe2\x82"), "\\xe2\\x82");                        /* ... at the end */
    CHECK_STR(SHOWN("\xc0\xaf"), "\\xc0\\xaf");                        /* overlong '/' */
    CHECK_STR(SHOWN("\xc1\x9b"), "\\xc1\\x9b");                        /* overlong ESC-range */
    CHECK_STR(SHOWN("\xe0\x80\x9b"), "\\xe0\\x80\\x9b");               /* overlong C1 */
    CHECK_STR(SHOWN("\xed\xa0\x80"), "\\xed\\xa0\\x80");               /* a surrogate */
    CHECK_STR(SHOWN("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");      /* past U+10FFFF */
    CHECK_STR(SHOWN("\xf4\x8f\xbf\xbf"), "\xf4\x8f\xbf\xbf");         /* U+10FFFF itself */
}

TEST(cli_untrusted_cuts_before_a_whole_character)
{
    char out[16];

    CHECK_STR(cli_untrusted(out, 7, "abcdef", 6), "abcdef");           /* fits with its NUL */
    CHECK_STR(cli_untrusted(out, 7, "abcdefg", 7), "abc...");
    CHECK_STR(cli_untrusted(out, 10, "abc\x1b" "def", 7), "abc...");    /* never half of \u001b */
    CHECK_STR(cli_untrusted(out, 7, "\xe4\xb8\xad\xe4\xb8\xad", 6), "\xe4\xb8\xad\xe4\xb8\xad");
    CHECK_STR(cli_untrusted(out, 7, "\xe4\xb8\xad\xe4\xb8\xad" "a", 7), "\xe4\xb8\xad...");
    CHECK_STR(cli_untrusted(out, 1, "abc", 3), "");
    CHECK_STR(cli_untrusted(out, 5, "", 0), "");
    CHECK_STR(cli_untrusted_str(out, sizeof(out), NULL), "-");
    out[0] = 'x';
    CHECK(cli_untrusted(out, 0, "abc", 3) == out && out[0] == 'x');     /* size 0: nothing written */
}

TEST(cli_untrusted_has_one_form_in_buffer_sbuf_and_stream)
{
    static const char in[] = "step\n42 \x1b[2J \xc2\x9b \xff \xe4\xb8\xad \x7f end";
    sbuf b = {0};
    char *text = NULL, *taken;
    size_t text_len = 0;
    FILE *f = open_memstream(&text, &text_len);

    CHECK(f != NULL);
    cli_untrusted_append(&b, in, sizeof(in) - 1);
    CHECK_EQ(cli_print_untrusted(f, in, sizeof(in) - 1), 0);
    CHECK_EQ(fclose(f), 0);
    taken = sb_take(&b);
    CHECK(taken != NULL);
    CHECK_STR(taken, SHOWN(in));
    CHECK_STR(text, SHOWN(in));
    CHECK_STR(text, "step\\u000a42 \\u001b[2J \\u009b \\xff \xe4\xb8\xad \\u007f end");
    free(taken);
    free(text);
}

/* ---- cli_body ---------------------------------------------------------------------------------- */

/* A file of header json (padded to a multiple of 8) and data bytes of data, in buf; returns its size. */
static size_t model(char *buf, size_t size, const char *json, size_t data)
{
    size_t n = strlen(json), padded = (n + 7) / 8 * 8;

    if (8 + padded + data > size)
        return 0;
    for (int i = 0; i < 8; i++)
        buf[i] = (char)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, json, n);
    memset(buf + 8 + n, ' ', padded - n);
    memset(buf + 8 + padded, 0x5a, data);
    return 8 + padded + data;
}

static const char W8[] = "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";

TEST(cli_body_takes_a_model_to_its_last_byte_in_any_chunks)
{
    char file[256];
    size_t size = model(file, sizeof(file), W8, 8);
    dl_error err;

    CHECK(size == 8 + 56 + 8);
    /* every chunk size, from a byte at a time to the whole file at once */
    for (size_t chunk = 1; chunk <= size; chunk++) {
        cli_body g = {0};
        for (size_t off = 0; off < size; off += chunk) {
            size_t n = size - off < chunk ? size - off : chunk;
            dl_error_clear(&err);
            if (cli_body_take(&g, file + off, n, &err) != 0) {
                fprintf(stderr, "  chunk %zu off %zu: %s\n", chunk, off, err.message);
                CHECK(0);
            }
        }
        CHECK_EQ(g.total, size);
        CHECK_EQ(g.received, size);
        /* one byte more is refused, whatever came before */
        CHECK(cli_body_take(&g, "x", 1, &err) < 0);
        CHECK_EQ(err.code, DL_E_METADATA_INCOMPLETE_BUFFER);
        CHECK(strstr(err.message, "more than the 72 bytes the model's header declares") != NULL);
        cli_body_reset(&g);
    }
}

TEST(cli_body_refuses_the_chunk_that_crosses_the_end)
{
    char file[256 + 16];
    size_t size = model(file, sizeof(file), "{}", 0);
    cli_body g = {0};
    dl_error err;

    CHECK_EQ(size, 16);
    memset(file + size, 0, 16);
    dl_error_clear(&err);
    /* the 16-byte model and what follows it in one chunk: none of it is taken */
    CHECK(cli_body_take(&g, file, 32, &err) < 0);
    CHECK(strstr(err.message, "more than the 16 bytes") != NULL);
    CHECK_EQ(g.received, 0);
    cli_body_reset(&g);
    /* with the model's header in a first chunk: the data-less file is complete at 16 */
    CHECK_EQ(cli_body_take(&g, file, 16, &err), 0);
    CHECK(cli_body_take(&g, file + 16, 1, &err) < 0);
    CHECK_EQ(g.received, 16);
    cli_body_reset(&g);
}

TEST(cli_body_wants_the_content_length_to_repeat_the_header)
{
    char file[256];
    size_t size = model(file, sizeof(file), W8, 8);
    cli_body g = {0};
    dl_error err;

    dl_error_clear(&err);
    cli_body_declare(&g, size);
    CHECK_EQ(cli_body_take(&g, file, size, &err), 0);
    cli_body_reset(&g);
    /* a Content-Length past the file: refused as soon as the header is in */
    cli_body_declare(&g, size + 1000000);
    CHECK_EQ(cli_body_take(&g, file, 8, &err), 0);
    CHECK(cli_body_take(&g, file + 8, 56, &err) < 0);
    CHECK_EQ(err.code, DL_E_METADATA_INCOMPLETE_BUFFER);
    CHECK(strstr(err.message, "declared a body of 1000072 bytes (Content-Length), the model's header a file of 72") !=
          NULL);
    cli_body_reset(&g);
    /* short of it: the same */
    cli_body_declare(&g, size - 1);
    CHECK(cli_body_take(&g, file, size - 1, &err) < 0);
    CHECK_EQ(err.code, DL_E_METADATA_INCOMPLETE_BUFFER);
    cli_body_reset(&g);
    /* short of the header: refused at the first 8 bytes, as every intake path refuses it */
    cli_body_declare(&g, 20);
    CHECK(cli_body_take(&g, file, 8, &err) < 0);
    CHECK_EQ(err.code, DL_E_INVALID_HEADER_LENGTH);
    cli_body_reset(&g);
    /* more bytes than declared are refused before anything else */
    cli_body_declare(&g, 4);
    CHECK(cli_body_take(&g, file, 5, &err) < 0);
    CHECK(strstr(err.message, "more than the 4 bytes it declared") != NULL);
    cli_body_reset(&g);
}

TEST(cli_body_refuses_a_bad_prefix_or_header_where_it_is_seen)
{
    char file[256];
    cli_body g = {0};
    dl_error err;

    /* a 1 TiB header: refused at its 8th byte */
    memset(file, 0, 16);
    file[5] = 1;
    dl_error_clear(&err);
    CHECK_EQ(cli_body_take(&g, file, 7, &err), 0);
    CHECK(cli_body_take(&g, file + 7, 1, &err) < 0);
    CHECK_EQ(err.code, DL_E_HEADER_TOO_LARGE);
    cli_body_reset(&g);
    /* text where the length belongs */
    CHECK(cli_body_take(&g, "<html><body>", 12, &err) < 0);
    CHECK(strstr(err.message, "not a safetensors file") != NULL);
    cli_body_reset(&g);
    /* a header that is not one: the parser's own refusal */
    CHECK(model(file, sizeof(file), "{\"w\":1}", 0) == 16);
    CHECK(cli_body_take(&g, file, 16, &err) < 0);
    CHECK(err.code != DL_OK);
    cli_body_reset(&g);
    /* an empty header (N = 0) is complete with its length, and refused */
    memset(file, 0, 8);
    CHECK(cli_body_take(&g, file, 8, &err) < 0);
    CHECK_EQ(g.total, 0);
    cli_body_reset(&g);
}
