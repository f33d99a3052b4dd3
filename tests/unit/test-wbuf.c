#include "test.h"

#include "wbuf.h"

TEST(wbuf_cuts_writes_at_units_and_carries_the_rest)
{
    wbuf b;
    char data[300];

    for (int i = 0; i < 300; i++)
        data[i] = (char)i;
    CHECK_EQ(wbuf_unit_left(0, 128), 128);
    CHECK_EQ(wbuf_unit_left(100, 128), 28);
    CHECK_EQ(wbuf_unit_left(256, 128), 128);
    CHECK_EQ(wbuf_init(&b, 160), 0);
    /* 150 bytes in, the write cut at the first unit: 128 out, 22 carried to the other buffer */
    CHECK_EQ(wbuf_append(&b, data, 150), 0);
    CHECK_EQ(wbuf_cut(&b, 0, 128, 0), 128);
    CHECK_EQ(wbuf_cut(&b, 0, 128, 1), 150);         /* the stream ended: all of it */
    CHECK_EQ(wbuf_cut(&b, 100, 128, 0), 28);
    CHECK_EQ(wbuf_cut(&b, 0, 256, 0), 150);         /* less than a unit left: all of it */
    CHECK_EQ(wbuf_swap(&b, wbuf_cut(&b, 0, 128, 0)), 0);
    CHECK(memcmp(b.out, data, 128) == 0);
    CHECK_EQ(b.fill_len, 22);
    CHECK(memcmp(b.fill, data + 128, 22) == 0);
    /* more than the buffer holds: it grows, nothing is lost */
    CHECK_EQ(wbuf_append(&b, data + 150, 150), 0);
    CHECK_EQ(b.fill_len, 172);
    CHECK(b.fill_cap >= 172);
    CHECK(memcmp(b.fill, data + 128, 172) == 0);
    /* a carry larger than the other buffer grows that one */
    CHECK_EQ(wbuf_swap(&b, 2), 0);
    CHECK(memcmp(b.out, data + 128, 2) == 0);
    CHECK_EQ(b.fill_len, 170);
    CHECK(b.fill_cap >= 170);
    CHECK(memcmp(b.fill, data + 130, 170) == 0);
    /* the end: everything out */
    CHECK_EQ(wbuf_swap(&b, b.fill_len), 0);
    CHECK(memcmp(b.out, data + 130, 170) == 0);
    CHECK_EQ(b.fill_len, 0);
    wbuf_free(&b);
    CHECK(b.fill == NULL && b.out == NULL);
}
