/* What quant_attend_vec.c shares with quant_attend.c: the vector level's work items (the
   signatures and their meaning: quant_attend_ref.h). */

#ifndef CARAMBA_QUANT_ATTEND_VEC_H
#define CARAMBA_QUANT_ATTEND_VEC_H

#include "quant_attend_ref.h"

HIDDEN key_item_fn key_item_vec;
HIDDEN value_item_fn value_item_vec;
HIDDEN key_item_zp_fn key_item_zp_vec, key_item_channel_vec;
HIDDEN value_item_zp_fn value_item_zp_vec;

#endif
